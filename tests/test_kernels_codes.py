"""One vocabulary across kernels (`dma_compile.kernels.codes`): each family of
codes is distinct, and no kernel module spells a code or log2(e) as a literal
or defines its own."""

import math
import re
from pathlib import Path

from dma_compile.kernels import codes

KERNELS = Path(codes.__file__).parent
LITERAL_CODE = re.compile(r"\b(?:\w*KIND|\w*FMT\d?|SELECT_V)\s*[!=]=\s*\d")
OWN_DEFINITION = re.compile(
    r"^(?:LOG2E|KIND_\w+|MASK_(?:NONE|BOOL|ADD\w*)|FMT_\w+|SELECT_V_\w+|\w*FMT_CODES)\s*=", re.M)


def test_each_family_of_codes_is_distinct():
    for prefix in ("KIND_", "MASK_", "FMT_", "SELECT_V_"):
        values = [v.value for name, v in vars(codes).items() if name.startswith(prefix)]
        assert len(values) >= 3 and len(set(values)) == len(values), prefix
    assert codes.MX_FORMAT_CODES["mxfp4_e2m1"] == codes.FMT_E2M1.value
    assert math.isclose(codes.LOG2E.value, 1 / math.log(2), rel_tol=1e-15)


def test_kernels_use_the_shared_names():
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "codes.py":
            continue
        text = path.read_text()
        assert "1.4426950408889634" not in text, f"{path.name}: use codes.LOG2E"
        assert not LITERAL_CODE.findall(text), f"{path.name}: compares a code with a literal"
        assert not OWN_DEFINITION.findall(text), f"{path.name}: defines a code of its own"
