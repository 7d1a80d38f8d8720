"""kernels.launch records a launch as Triton's launcher would specialise it, and its contexts nest and restore.

A record (:class:`kernels.launch.Launch`) is what the compile check compiles ahead for a GPU, so its key must be
the key Triton compiles: the type of every runtime argument (``i32`` below 2**31, ``i64`` from there), an integer
equal to 1 turned into a constant, and the arguments compiled as divisible by 16 (an integer that is a multiple of
16, a pointer whose byte offset is). The expectations are written out by hand from those rules for arguments
chosen here (tensor views with known offsets, sizes with known residues), then compared with the record.
"""
from __future__ import annotations

import pytest
import torch

from kernels import launch as kl
from tests.kernels.harness import needs_triton

pytestmark = needs_triton


def _scan_kernel():
    from kernels.scan.triton import _scan_fwd  # (A, X, S0, STARTS, FIN, n, D, HAS_INIT, BLOCK)
    return _scan_fwd


def _compiled_scan_kernel():
    """The same kernel as the compiler sees it (the interpreter's function lists no constexprs; a record is only
    made, never run, so no GPU is needed)."""
    from triton.runtime.jit import JITFunction
    return JITFunction(_scan_kernel().fn)


def _view(dtype, offset, size=64):
    """A view ``offset`` elements into a fresh tensor (its byte offset is ``offset * element size``)."""
    return torch.randn(size + offset).to(dtype)[offset:]


def test_a_record_names_argument_types_constants_and_aligned_arguments_as_triton_specialises_them():
    kernel = _compiled_scan_kernel()
    # byte offsets: 1 * 4 = 4 (no), 4 * 4 = 16 (yes), 4 * 2 = 8 (no), 8 * 2 = 16 (yes), 0 (yes)
    offsets = {"A": (torch.float32, 1), "X": (torch.float32, 4), "S0": (torch.float16, 4),
               "STARTS": (torch.float16, 8), "FIN": (torch.float32, 0)}
    pointers = {name: _view(dtype, off) for name, (dtype, off) in offsets.items()}
    aligned_pointers = {name for name, (dtype, off) in offsets.items()
                        if off * torch.empty(0, dtype=dtype).element_size() % 16 == 0}
    assert aligned_pointers == {"X", "STARTS", "FIN"}
    n = 16 * int(torch.randint(0, 5, ())) + 8                                # a multiple of 8, not of 16
    D = 16 * int(torch.randint(1, 5, ()))                                      # a multiple of 16
    block = 16
    with kl.recording() as records:
        kl.launch(kernel, (1, 1), *pointers.values(), n, D, HAS_INIT=True, BLOCK=block)
    (rec,) = records
    types = {torch.float32: "*fp32", torch.float16: "*fp16"}
    assert rec.signature == tuple((name, types[dtype]) for name, (dtype, _) in offsets.items()) + \
        (("n", "i32"), ("D", "i32"))
    assert set(rec.aligned) == aligned_pointers | {"D"}
    assert dict(rec.constexprs) == {"HAS_INIT": True, "BLOCK": block}
    assert rec.name == "scan._scan_fwd"
    assert rec.config() == (True, {"HAS_INIT": True, "BLOCK": block})     # fp16 pointers among the arguments


@pytest.mark.parametrize("value, expected", [(2**31 - 1, "i32"), (2**31, "i64"), (-2**31, "i32"),
                                             (-2**31 - 1, "i64"), (3, "i32")])
def test_an_integer_argument_is_i32_below_two_to_the_31_and_i64_from_there(value, expected):
    kernel = _compiled_scan_kernel()
    x = torch.randn(8)
    with kl.recording() as records:
        kl.launch(kernel, (1, 1), x, x, x, x, x, value, 3, HAS_INIT=False, BLOCK=16)
    assert dict(records[0].signature)["n"] == expected


def test_an_integer_equal_to_one_is_a_constant_and_not_an_argument():
    kernel = _compiled_scan_kernel()
    x = torch.randn(8)
    with kl.recording() as records:
        kl.launch(kernel, (1, 1), x, x, x, x, x, 1, 32, HAS_INIT=False, BLOCK=16)
    (rec,) = records
    assert "n" not in dict(rec.signature) and dict(rec.constexprs)["n"] == 1
    assert "D" in rec.aligned and "n" not in rec.aligned


def test_nested_recordings_share_one_list_and_tag_each_launch_with_the_innermost_tags():
    kernel = _compiled_scan_kernel()
    x = torch.randn(8)

    def one_launch(n):
        kl.launch(kernel, (1, 1), x, x, x, x, x, n, 3, HAS_INIT=False, BLOCK=16)

    with kl.recording(("outer",)) as outer:
        one_launch(2)
        with kl.recording(("inner",)) as inner:
            one_launch(5)
        one_launch(7)
    assert inner is outer
    assert [(r.tags, dict(r.signature)["n"]) for r in outer] == [(("outer",), "i32"), (("inner",), "i32"),
                                                                  (("outer",), "i32")]
    assert kl._recorder is None and kl._recorder_tags == []


def _run_scan(n_chunks=3):
    """One launch of the forward scan kernel on fresh inputs; returns (final state, the loop's final state)."""
    kernel = _scan_kernel()
    D = int(torch.randint(2, 9, ()))
    a, X = torch.rand(1, n_chunks), torch.randn(1, n_chunks, D)
    starts, fin = torch.full((1, n_chunks, D), float("nan")), torch.full((1, D), float("nan"))
    kl.launch(kernel, (1, 1), a, X, fin, starts, fin, n_chunks, D, HAS_INIT=False, BLOCK=16)
    S = torch.zeros(D)
    for c in range(n_chunks):
        S = a[0, c] * S + X[0, c]
    return fin[0], S


def test_an_inner_count_that_does_not_execute_holds_the_kernel_back_even_inside_one_that_does():
    with kl.counting() as outer:
        with kl.counting(execute=False) as inner:
            fin, _ = _run_scan()
        assert torch.isnan(fin).all()                  # did not run
        fin, expected = _run_scan()                    # the outer count alone: runs
    torch.testing.assert_close(fin, expected)
    assert inner["scan._scan_fwd"] == 1 and outer["scan._scan_fwd"] == 2
    with kl.counting(execute=False) as outer:
        with kl.counting() as inner:
            fin, expected = _run_scan()
    torch.testing.assert_close(fin, expected)          # the innermost count decides
    assert inner["scan._scan_fwd"] == outer["scan._scan_fwd"] == 1


def test_launching_is_true_only_while_a_kernel_runs_even_when_it_fails():
    seen = []

    class Probe:
        fn = _scan_kernel()

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(kl.launching())
                raise RuntimeError("the kernel failed")
            return run

    assert not kl.launching()
    with pytest.raises(RuntimeError, match="the kernel failed"):
        kl.launch(Probe(), (1,), torch.randn(4))
    assert seen == [True] and not kl.launching()
    fin, expected = _run_scan()
    torch.testing.assert_close(fin, expected)
    assert not kl.launching()


def test_host_only_nests_and_the_outer_one_still_holds_after_an_inner_one():
    with kl.host_only():
        with kl.host_only():
            fin, _ = _run_scan()
            assert torch.isnan(fin).all()
        fin, _ = _run_scan()
        assert torch.isnan(fin).all()                  # still host only
    fin, expected = _run_scan()
    torch.testing.assert_close(fin, expected)


@pytest.mark.parametrize("dtype, sixteen", [(torch.float32, False), (torch.float16, True), (torch.bfloat16, True)])
def test_a_launch_configuration_says_whether_a_tensor_is_sixteen_bit_and_gives_every_constexpr(dtype, sixteen):
    kernel = _scan_kernel()
    x, h = torch.randn(8), torch.randn(8).to(dtype)
    block = int(2 ** torch.randint(4, 8, ()))
    got = kl.launch_config(kernel, (x, x, x, h, x, 3, 8), {"HAS_INIT": False, "BLOCK": block, "num_warps": 2})
    assert got == (sixteen, {"HAS_INIT": False, "BLOCK": block})
    positional = kl.launch_config(kernel, (x, x, x, x, h, 3, 8, True, block), {})
    assert positional == (sixteen, {"HAS_INIT": True, "BLOCK": block})


MEASURED = {"card": "test card", "commit": "0000000", "mixer": "jordan", "T": 64, "d_model": 32, "head_dim": 16,
            "dtype": "fp32", "launcher_ms": 1.0, "ms": 0.5}


def _entry(consts, warps=4, stages=2, sixteen=True):
    return {"kernel": "x.k", "sixteen_bit": sixteen, "constexprs": consts, "num_warps": warps, "num_stages": stages,
            "measured": MEASURED}


def test_a_lookup_after_a_merge_sees_the_merged_options(tmp_path):
    from kernels import launch_table as lt
    lt.options_by_kernel.cache_clear()
    consts = {"A": int(torch.randint(1, 100, ())), "B": 64, "C": True}
    lt.merge(90, [_entry(consts, warps=4)], tmp_path)
    assert lt.lookup(90, "x.k", True, consts, str(tmp_path)) == {"num_warps": 4, "num_stages": 2}
    lt.merge(90, [_entry(consts, warps=8)], tmp_path)
    assert lt.lookup(90, "x.k", True, consts, str(tmp_path)) == {"num_warps": 8, "num_stages": 2}
    # the constexprs match whatever order a launcher names them in
    assert lt.lookup(90, "x.k", True, dict(reversed(list(consts.items()))), str(tmp_path)) == \
        {"num_warps": 8, "num_stages": 2}
    lt.options_by_kernel.cache_clear()


@pytest.mark.parametrize("stages", [0, 9, 2.0])
def test_a_table_entry_with_stages_outside_one_to_eight_is_refused(tmp_path, stages):
    import json

    from kernels import launch_table as lt
    path = lt.table_path(90, tmp_path)
    path.write_text(json.dumps({"format": 1, "arch": 90, "entries": [_entry({"B": 64}, stages=stages)]}))
    with pytest.raises(lt.LaunchTableError, match=rf"entry 0 \(x.k\): num_stages {stages!r} is not an integer"):
        lt.read(path)


def test_a_nested_forced_architecture_keeps_the_outer_tables_unless_given_its_own(tmp_path):
    from kernels import launch_table as lt
    assert lt.forced_arch is None and lt.directory() is None
    with lt.as_if_arch(90, tmp_path):
        with lt.as_if_arch(80):
            assert (lt.forced_arch, lt.directory()) == (80, str(tmp_path))
        with lt.as_if_arch(80, tmp_path / "other"):
            assert (lt.forced_arch, lt.directory()) == (80, str(tmp_path / "other"))
        assert (lt.forced_arch, lt.directory()) == (90, str(tmp_path))
    assert lt.forced_arch is None and lt.directory() is None


def test_kernels_run_says_false_wherever_a_launch_returns_before_its_kernel():
    assert kl.kernels_run()
    with kl.host_only():
        assert not kl.kernels_run()
    with kl.recording():
        assert not kl.kernels_run()
    with kl.counting(execute=False):
        assert not kl.kernels_run()
        with kl.counting():           # the innermost counter decides, as it does for the launch
            assert kl.kernels_run()
    with kl.counting():
        assert kl.kernels_run()
    assert kl.kernels_run()


@needs_triton
def test_slot_numbers_are_not_checked_where_the_addressing_kernel_did_not_run():
    """Inside ``counting(execute=False)`` the slot numbers the Triton top-k would write are uninitialised: the
    slot memory must not read them as bad input (the launch counts of a layer are taken that way)."""
    from kernels.slots import slot_memory
    M, T = 6, 3
    garbage = torch.full((1, T, 1, 2), -(2 ** 60), dtype=torch.long)
    w = torch.rand(1, T, 1, 2)
    with kl.counting(execute=False):
        slot_memory(garbage, w, garbage, w, torch.randn(1, T, 1, 3), torch.ones(1), M, backend="triton")
    with pytest.raises(ValueError, match="outside 0..5"):
        slot_memory(garbage, w, garbage, w, torch.randn(1, T, 1, 3), torch.ones(1), M, backend="triton")
