"""kernels/sass.py: finding the matmul loops in SASS and the spills inside them."""

from dma_compile.kernels.sass import counted_spills, longest_chain, matmul_loops

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2 ;
        /*0020*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ ;
        /*0030*/                   LDL R3, [R1] ;
        /*0040*/                   STL [R1+0x4], R3 ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   LDL R4, [R1+0x4] ;
        /*0070*/                   HGMMA.64x128x16.F32 R24, gdesc[UR8], RZ ;
        /*0080*/               @P1 BRA 0x70 ;
        /*0090*/                   FADD R5, R5, R6 ;
        /*00a0*/               @P2 BRA 0x90 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0x20 ;
"""


def test_innermost_matmul_loops_and_their_spills():
    loops = matmul_loops(SASS)
    # 0x20-0x50 and 0x70-0x80 issue matmuls; 0x90-0xa0 does not; the branch
    # after EXIT is a retry path, not a loop.
    assert [(loop["start"], loop["end"]) for loop in loops] == [(0x20, 0x50), (0x70, 0x80)]
    assert (loops[0]["local_loads"], loops[0]["local_stores"], loops[0]["matmuls"]) == (1, 1, 1)
    assert (loops[1]["local_loads"], loops[1]["local_stores"]) == (0, 0)


def test_an_outer_loop_is_not_innermost():
    outer = SASS.replace("/*0090*/                   FADD R5, R5, R6 ;", "/*0090*/               @P3 BRA 0x20 ;")
    assert [(loop["start"], loop["end"]) for loop in matmul_loops(outer)] == [(0x20, 0x50), (0x70, 0x80)]


def test_fp8_matmul_loops_and_their_barriers_count():
    fp8 = SASS.replace("HGMMA.64x128x16.F32 R24, gdesc[UR8]", "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8]")
    # A barrier between the loops, then one inside the first.
    fp8 = fp8.replace("LDL R4, [R1+0x4] ;", "BAR.SYNC.DEFER_BLOCKING 0x0 ;")
    loops = matmul_loops(fp8)
    assert [(loop["start"], loop["end"], loop["matmuls"]) for loop in loops] == [(0x20, 0x50, 1), (0x70, 0x80, 1)]
    assert [loop["barriers"] for loop in loops] == [0, 0]
    in_loop = fp8.replace("LDL R3, [R1] ;", "BAR.SYNC 0x2, 0x80 ;")
    assert [loop["barriers"] for loop in matmul_loops(in_loop)] == [1, 0]


def test_counted_spills_are_the_loops_or_all_where_no_loop_is_found():
    assert counted_spills(SASS) == 2
    no_matmul = SASS.replace("HGMMA", "HMMA")
    assert matmul_loops(no_matmul) == [] and counted_spills(no_matmul) == 4


def _maxima(pairs: list[tuple[int, int, int]]) -> list[str]:
    return [f"FMNMX R{d}, R{a}, R{b}, !PT ;" for d, a, b in pairs]


def test_longest_chain_tells_a_folded_row_from_a_tree():
    # Eight values R10..R17: folded into one accumulator (7 deep) or pairwise (3 deep).
    folded = _maxima([(20, 10, 11)] + [(20, 20, r) for r in range(12, 18)])
    tree = _maxima([(20, 10, 11), (21, 12, 13), (22, 14, 15), (23, 16, 17), (20, 20, 21), (22, 22, 23),
                    (20, 20, 22)])
    assert longest_chain(folded, "FMNMX") == 7
    assert longest_chain(tree, "FMNMX") == 3
    # Another instruction writing a register starts its chain again; other opcodes do not count.
    broken = folded[:3] + ["SHFL.BFLY PT, R20, R20, 0x1, 0x1f ;"] + folded[3:]
    assert longest_chain(broken, "FMNMX") == 4
    assert longest_chain(["@P0 FADD R5, R5, R6 ;", "FADD R5, R5, -R7 ;", "FMUL R5, R5, R6 ;"], "FADD") == 2


def test_matmul_loops_report_their_reduction_chains():
    body = ["HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ ;"] + _maxima([(20, 10, 11)] + [(20, 20, r) for r in range(12, 18)])
    body += ["FADD R30, R31, R32 ;", "@P0 BRA 0x0 ;", "EXIT ;"]
    code = "\n".join(f"        /*{16 * i:04x}*/                   {text}" for i, text in enumerate(body))
    (loop,) = matmul_loops(code)
    assert (loop["max_chain"], loop["add_chain"]) == (7, 1)
