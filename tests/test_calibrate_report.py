"""dma_compile.calibrate.report: the short policy names the tables print."""

from dma_compile.calibrate.report import describe
from dma_compile.policy import AttentionPolicy


def test_describe_names_formats_tiles_pv_and_rotation():
    paper = AttentionPolicy.paper()
    assert describe(paper) == "mxfp8/mxfp4 d1 s1, pv input"
    assert describe(paper.replace(rotate="signed_hadamard", pv="fp8")) == "mxfp8/mxfp4 d1 s1, pv fp8, signed hadamard"
    assert describe(paper.replace(hi="mxfp4_e2m1", rotate="hadamard")) == "mxfp4 all, pv input, hadamard"
    assert describe(AttentionPolicy.preset("paper_balanced")) == "mxfp8/mxfp4 d1 s1, pv input, signed hadamard, balanced"
