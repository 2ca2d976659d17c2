"""pallas_kernels: each op against its plain-jnp reference, bitwise, on hypothesis-drawn inputs.

Each op has a base class that runs the public op as a user would (``implementation="auto"``: the
compiled Pallas kernel on GPU, XLA elsewhere) and an ``Interpret`` subclass (``INTERPRET =
True``) that runs the Pallas kernel itself in interpret mode, so the kernels are checked on the
CPU too. Outputs are poisoned before each run (the slab that ``pack_lines`` updates in place,
the ``out`` buffer that ``gather_lines`` writes into, the counters that ``lfu_update`` ages), so
an element a kernel forgets to write, or writes twice, shows up.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import pallas_kernels as pk
from pallas_kernels._common import resolve

DTYPES = [np.float32, jnp.bfloat16, np.int8, np.uint8]
WIDTHS = [1, 3, 8, 24, 64, 2048 + 1024]  # 3072: three 1024-wide pieces per line; 3: pieces of 1
# Each example with a new shape compiles the kernel again; a few cover the shapes and dtypes.
# The Interpret subclasses run the same test methods on purpose (hence differing_executors).
EXAMPLES = settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)


def _bytes(x) -> tuple:
    a = np.asarray(x)
    return a.shape, a.dtype, a.tobytes()


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Random bit patterns of ``dtype``, NaNs replaced by 1.5 (infinities and -0.0 stay).

    NaN payloads are not compared here: a float operation may quiet a signalling NaN. The ops
    move floats as words (`pallas_kernels._common.as_words`); `test_every_bit_pattern_arrives`
    checks every 16-bit pattern. The device slab stores words (uint32/uint8), never floats.
    """
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    out = raw.view(dtype).reshape(shape).copy()
    if np.issubdtype(dtype, np.floating) or dtype == jnp.bfloat16:
        out[np.isnan(out.astype(np.float32))] = 1.5
    return out


def _poison(shape: tuple[int, ...], dtype, byte: int) -> np.ndarray:
    """An array whose every byte is ``byte``: what a forgotten element would still hold."""
    dtype = np.dtype(dtype)
    return np.full(int(np.prod(shape)) * dtype.itemsize, byte, np.uint8).view(dtype).reshape(shape)


class PackLinesTest:
    """`pack_lines` against `pack_lines_reference`."""

    INTERPRET = False

    def run(self, slab, lines, slots):
        impl = "pallas" if self.INTERPRET else "auto"
        return pk.pack_lines(slab, lines, slots, implementation=impl, interpret=self.INTERPRET)

    @EXAMPLES
    @given(
        dtype=st.sampled_from(DTYPES),
        num_lines=st.integers(1, 12),
        width=st.sampled_from(WIDTHS),
        data=st.data(),
    )
    def test_matches_reference_and_leaves_other_lines_alone(self, dtype, num_lines, width, data):
        slots = data.draw(st.lists(st.integers(0, num_lines - 1), unique=True, max_size=num_lines))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        lines = _random(rng, (len(slots), width), dtype)
        poison = _poison((num_lines, width), dtype, data.draw(st.sampled_from([0xA5, 0x7F, 0x5A])))
        slots = np.asarray(slots, np.int32)
        want = pk.pack_lines_reference(jnp.asarray(poison), jnp.asarray(lines), jnp.asarray(slots))
        got = self.run(jnp.asarray(poison), jnp.asarray(lines), jnp.asarray(slots))
        assert _bytes(got) == _bytes(want)
        untouched = np.setdiff1d(np.arange(num_lines), slots)
        assert np.asarray(got)[untouched].tobytes() == poison[untouched].tobytes()

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
    def test_every_bit_pattern_arrives(self, dtype):
        # All 65,536 patterns of a 16-bit float, subnormals and signalling NaNs included, against
        # numpy's bytes (XLA's scatter on the CPU, the reference's before, flushed 252 bfloat16
        # patterns, and so did the kernel in interpret mode).
        bits = np.arange(65536, dtype=np.uint16).reshape(64, 1024)
        slots = np.arange(64, dtype=np.int32)[::-1].copy()
        got = self.run(jnp.zeros((64, 1024), dtype), jnp.asarray(bits.view(dtype)),
                       jnp.asarray(slots))
        want = np.zeros_like(bits)
        want[slots] = bits
        assert np.array_equal(np.asarray(got).view(np.uint16), want)

    def test_updates_the_slab_in_place(self):
        slab = jnp.zeros((64, 256), jnp.uint32)
        pointer = slab.unsafe_buffer_pointer()
        out = self.run(slab, jnp.ones((3, 256), jnp.uint32), jnp.array([5, 1, 63], jnp.int32))
        assert slab.is_deleted(), "the slab must be donated, not copied"
        assert out.unsafe_buffer_pointer() == pointer
        assert np.asarray(out)[[1, 5, 63]].min() == 1 and np.asarray(out).sum() == 3 * 256

    def test_host_slots_are_checked(self):
        slab, lines = jnp.zeros((4, 2)), jnp.ones((2, 2))
        with pytest.raises(ValueError, match="slot 4 is outside the slab's 4 lines"):
            self.run(slab, lines, np.array([0, 4]))
        with pytest.raises(ValueError, match="repeat a slot"):
            self.run(jnp.zeros((4, 2)), lines, np.array([1, 1]))
        with pytest.raises(ValueError, match="slab's width and dtype"):
            self.run(jnp.zeros((4, 3)), lines, np.array([0, 1]))


class PackLinesInterpretTest(PackLinesTest):
    INTERPRET = True


class GatherLinesTest:
    """`gather_lines` against `gather_lines_reference`."""

    INTERPRET = False

    def run(self, slab, slots, **kw):
        impl = "pallas" if self.INTERPRET else "auto"
        return pk.gather_lines(slab, slots, implementation=impl, interpret=self.INTERPRET, **kw)

    @EXAMPLES
    @given(
        dtype=st.sampled_from(DTYPES),
        num_lines=st.integers(1, 12),
        width=st.sampled_from(WIDTHS),
        data=st.data(),
    )
    def test_matches_reference_with_repeated_slots(self, dtype, num_lines, width, data):
        slots = data.draw(st.lists(st.integers(0, num_lines - 1), min_size=1, max_size=16))
        slots = np.asarray(slots + slots[:1], np.int32)  # at least one repeat
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        slab = _random(rng, (num_lines, width), dtype)
        want = pk.gather_lines_reference(jnp.asarray(slab), jnp.asarray(slots))
        poisoned = _poison((len(slots), width), dtype, data.draw(st.sampled_from([0xA5, 0x7F])))
        got = self.run(jnp.asarray(slab), jnp.asarray(slots), out=jnp.asarray(poisoned))
        assert _bytes(got) == _bytes(want)
        assert _bytes(self.run(jnp.asarray(slab), jnp.asarray(slots))) == _bytes(want)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
    def test_every_bit_pattern_arrives(self, dtype):
        # All 65,536 patterns of a 16-bit float, subnormals and signalling NaNs included, against
        # numpy's bytes (the kernel in interpret mode flushed 252 bfloat16 patterns to zero).
        bits = np.arange(65536, dtype=np.uint16).reshape(64, 1024)
        slots = np.arange(64, dtype=np.int32)[::-1].copy()
        got = self.run(jnp.asarray(bits.view(dtype)), jnp.asarray(slots))
        assert np.array_equal(np.asarray(got).view(np.uint16), bits[slots])

    def test_writes_into_the_given_buffer(self):
        slab = jnp.arange(64 * 8, dtype=jnp.uint32).reshape(64, 8)
        out = jnp.zeros((3, 8), jnp.uint32)
        pointer = out.unsafe_buffer_pointer()
        got = self.run(slab, jnp.array([7, 7, 0], jnp.int32), out=out)
        assert got.unsafe_buffer_pointer() == pointer
        assert np.asarray(got)[:, 0].tolist() == [56, 56, 0]

    def test_bad_out_buffer_is_named(self):
        with pytest.raises(ValueError, match=r"out \(2, 8\) uint32 must be \(3, 8\)"):
            self.run(
                jnp.zeros((4, 8), jnp.uint32),
                jnp.array([0, 1, 2]),
                out=jnp.zeros((2, 8), jnp.uint32),
            )


class GatherLinesInterpretTest(GatherLinesTest):
    INTERPRET = True


class LfuUpdateTest:
    """`lfu_update` against `lfu_update_reference`, with repeated and out-of-range ids."""

    INTERPRET = False

    def run(self, counters, ids, **kw):
        impl = "pallas" if self.INTERPRET else "auto"
        return pk.lfu_update(counters, ids, implementation=impl, interpret=self.INTERPRET, **kw)

    @EXAMPLES
    @given(
        dtype=st.sampled_from([np.float32, np.int32, np.uint32]),
        num_keys=st.sampled_from([1, 7, 96, 256, 768, 1000]),
        data=st.data(),
    )
    def test_matches_reference(self, dtype, num_keys, data):
        ids = data.draw(st.lists(st.integers(-3, num_keys + 2), max_size=70))
        if ids:
            ids += ids[: data.draw(st.integers(1, len(ids)))]  # every drawn id may repeat
        ids = np.asarray(ids, np.int32)
        if ids.size % 2 == 0 and data.draw(st.booleans()):
            ids = ids.reshape(2, -1)  # ids of any shape count alike
        if np.dtype(dtype) == np.float32:
            decay = data.draw(st.sampled_from([1.0, 0.5, 0.9, 0.999]))
        else:
            decay = data.draw(st.sampled_from([1.0, 0.5, 0.25]))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        # Poisoned counters: large random values, so that a kernel that writes counts without
        # aging what was there (or ages twice) differs from the reference.
        start = (rng.random(num_keys) * 1e6).astype(dtype)
        want = pk.lfu_update_reference(jnp.asarray(start), jnp.asarray(ids), decay=decay)
        got = self.run(jnp.asarray(start), jnp.asarray(ids), decay=decay)
        assert _bytes(got) == _bytes(want)
        if decay == 1.0:
            counts = np.bincount(ids[(ids >= 0) & (ids < num_keys)], minlength=num_keys)
            assert np.array_equal(np.asarray(got) - start, counts.astype(dtype))

    def test_duplicates_count_each_time_and_update_in_place(self):
        counters = jnp.zeros(512, jnp.int32)
        pointer = counters.unsafe_buffer_pointer()
        got = self.run(counters, jnp.array([3, 3, 3, 500, 3], jnp.int32))
        assert counters.is_deleted() and got.unsafe_buffer_pointer() == pointer
        assert np.asarray(got)[[3, 500]].tolist() == [4, 1] and int(got.sum()) == 5

    def test_bad_decay_is_named(self):
        with pytest.raises(ValueError, match="decay=0.9 must be a power of 1/2"):
            self.run(jnp.zeros(4, jnp.int32), jnp.array([1]), decay=0.9)
        with pytest.raises(ValueError, match=r"decay=1.5 must be in \(0, 1\]"):
            self.run(jnp.zeros(4, jnp.float32), jnp.array([1]), decay=1.5)


class LfuUpdateInterpretTest(LfuUpdateTest):
    INTERPRET = True


# ------------------------------------------------------------------------ selection, lowering


def test_auto_is_pallas_on_gpu_only():
    want = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert resolve("auto", False, op="x") == want
    assert resolve("xla", True, op="x") == "xla"
    with pytest.raises(ValueError, match="implementation='cuda' must be one of"):
        pk.gather_lines(jnp.zeros((2, 2)), jnp.array([0]), implementation="cuda")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the kernels compile on a GPU")
def test_compiled_pallas_off_gpu_says_what_to_do():
    with pytest.raises(ValueError, match="pass interpret=True.*or implementation='xla'"):
        pk.lfu_update(jnp.zeros(4), jnp.array([1]), implementation="pallas")


@pytest.mark.parametrize("dtype", DTYPES + [np.uint32])
def test_kernels_lower_to_triton_for_cuda(dtype):
    """Each kernel lowers through Pallas' Triton backend for CUDA, on any machine.

    This checks the kernels against the Triton lowering rules of the installed JAX (block
    shapes, dynamic row indexing, the counting loop); compiling Triton IR to PTX happens only on
    a GPU (``bench/gpu_check.sh``).
    """
    from jax import export

    from pallas_kernels.gather_lines import _gather_lines_pallas
    from pallas_kernels.lfu_update import _lfu_update_pallas
    from pallas_kernels.pack_lines import _pack_lines_pallas

    s = jax.ShapeDtypeStruct
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    cases = [
        (
            functools.partial(_pack_lines_pallas, interpret=False),
            (s((64, 3072), dtype), s((3, 3072), dtype), s((3,), jnp.int32)),
        ),
        (
            functools.partial(_gather_lines_pallas, interpret=False),
            (s((64, 24), dtype), s((5,), jnp.int32), s((5, 24), dtype)),
        ),
        (
            functools.partial(_lfu_update_pallas, decay=0.5, interpret=False),
            (s((1000,), jnp.int32), s((70,), jnp.int32)),
        ),
    ]
    for fn, args in cases:
        module = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
        assert "__gpu$xla.gpu.triton" in module.mlir_module()


def test_package_imports_nothing_of_ours():
    code = (
        "import sys, pallas_kernels\n"
        "ours = [m for m in sys.modules if m.split('.')[0] in "
        "('cacheflow_jax', 'predictor', 'training', 'bench')]\n"
        "assert not ours, ours\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
