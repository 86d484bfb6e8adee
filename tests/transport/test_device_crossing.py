"""An upload crosses to the device while it arrives (aggsrv.transport.crossing): what crosses is
bit for bit what the decoder finished, stretch by stretch as the chunks land, whatever the
order the tensors' chunks interleave in, and a section decoded only at the end crosses then.

On the CPU the crossing copies synchronously into host tensors of its own: the bookkeeping is
the same as on a GPU, where the copies run on a stream of their own."""

from __future__ import annotations

import random

import pytest
import torch

from aggsrv.transport import (
    Crc32c,
    Decoder,
    DeviceCrossing,
    Encoding,
    StagingSlot,
    WireDtype,
    encode_sparse,
    iter_chunks,
)


def _interleaved(tensors: dict[str, torch.Tensor], wd: WireDtype, chunk: int, seed: int):
    """Every tensor's chunks in order, the tensors interleaved at random."""
    queues = {n: list(iter_chunks({n: t}, wd, chunk)) for n, t in tensors.items()}
    rng = random.Random(seed)
    out = []
    while queues:
        name = rng.choice(sorted(queues))
        out.append(queues[name].pop(0))
        if not queues[name]:
            del queues[name]
    return out


@pytest.mark.parametrize("wd", [WireDtype.FLOAT32, WireDtype.BFLOAT16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_what_crosses_is_what_the_decoder_finished(wd: WireDtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    sizes = {"a": 1 + int(torch.randint(300, 900, (1,), generator=gen)), "b": 517, "c": 3}
    extras = {"buffers": 41}
    slot = StagingSlot(sum(sizes.values()), extras)
    tensors = {n: torch.randn(k, generator=gen) for n, k in {**sizes, **extras}.items()}
    step = 64 * 4  # a copy per 64 elements landed
    crossing = DeviceCrossing(slot, "cpu", step_bytes=step)
    for upload in range(2):  # the slot and the crossing are reused; each upload its own tensors
        if upload:
            tensors = {n: t * -3.0 for n, t in tensors.items()}
        dec = Decoder(slot, {n: t.numel() for n, t in tensors.items()}, wd, 1 << 20)
        crossing.begin()
        crc = Crc32c()
        seen_copies = []
        for name, offset, data in _interleaved(tensors, wd, 4 * wd.itemsize * 9, seed + upload):
            crc.update(data)
            dec.feed(name, offset, data)
            crossing.progress(dec.decoded())
            seen_copies.append(crossing.copies)
        # The copies were queued as the chunks landed, not at the end.
        assert seen_copies[len(seen_copies) // 2] >= 4, seen_copies
        views = dec.finish(crc.value, crc.nbytes)
        crossed = crossing.finish(views, dec.decoded())
        assert set(crossed) == set(views)
        for name, view in views.items():
            assert torch.equal(crossed[name], view), name
            assert crossed[name].data_ptr() != view.data_ptr()  # its own memory
        if upload == 0:
            first = {n: t.clone() for n, t in crossed.items()}
            kept = crossed
    # A strategy may keep what the first upload gave it: the second did not overwrite it.
    for name in first:
        assert torch.equal(kept[name], first[name])


def test_a_section_decoded_at_the_end_crosses_at_the_end() -> None:
    gen = torch.Generator().manual_seed(7)
    numel = 997
    x = torch.zeros(numel)
    x[torch.randperm(numel, generator=gen)[:40]] = torch.randn(40, generator=gen)
    payload, nnz = encode_sparse(x, WireDtype.FLOAT32, Encoding.COO)
    slot = StagingSlot(numel)
    slot.flat.fill_(7.0)
    dec = Decoder(slot, {"u": numel}, WireDtype.FLOAT32, 64, sparse={"u": (Encoding.COO, nnz)})
    crossing = DeviceCrossing(slot, "cpu", step_bytes=16)
    crossing.begin()
    crc = Crc32c()
    for start in range(0, payload.nbytes, 64):
        piece = bytes(payload[start : start + 64])
        crc.update(piece)
        dec.feed("u", start, piece)
        crossing.progress(dec.decoded())
    assert crossing.copies == 0  # nothing of a sparse section is final before the end
    views = dec.finish(crc.value, crc.nbytes)
    crossed = crossing.finish(views, dec.decoded())
    assert torch.equal(crossed["u"], x) and crossing.copies == 1


def test_chunks_before_begin_and_after_abandon_are_refused() -> None:
    slot = StagingSlot(8)
    crossing = DeviceCrossing(slot, "cpu")
    with pytest.raises(RuntimeError, match="begin"):
        crossing.progress([("u", slot.flat, 8)])
    crossing.begin()
    crossing.progress([("u", slot.flat, 8)])
    crossing.abandon()
    with pytest.raises(RuntimeError, match="begin"):
        crossing.finish({"u": slot.flat}, [("u", slot.flat, 8)])
    assert slot.idle()
    with pytest.raises(ValueError, match="step_bytes"):
        DeviceCrossing(slot, "cpu", step_bytes=0)


def test_a_view_outside_the_slot_is_refused() -> None:
    slot = StagingSlot(8)
    crossing = DeviceCrossing(slot, "cpu")
    crossing.begin()
    with pytest.raises(ValueError, match="not in the slot"):
        crossing.finish({"u": torch.zeros(8)}, [])


def _arrive(slot: StagingSlot, crossing: DeviceCrossing, data: torch.Tensor, chunk: int):
    """An upload of ``data`` as tensor "u" in chunks of ``chunk`` bytes, each followed by the
    crossing's progress: (the decoder, its finished views)."""
    dec = Decoder(slot, {"u": data.numel()}, WireDtype.FLOAT32, 1 << 20)
    crossing.begin()
    crc = Crc32c()
    for name, offset, piece in iter_chunks({"u": data}, WireDtype.FLOAT32, chunk):
        crc.update(piece)
        dec.feed(name, offset, piece)
        crossing.progress(dec.decoded())
    return dec, dec.finish(crc.value, crc.nbytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_copies_are_stream_ordered_and_fence_the_slot() -> None:
    numel = (3 << 20) + 5
    slot = StagingSlot(numel, pin_memory=True)
    data = torch.randn(numel)
    crossing = DeviceCrossing(slot, "cuda", step_bytes=1 << 20)
    dec, views = _arrive(slot, crossing, data, 1 << 20)
    with torch.cuda.stream(crossing._stream):  # hold the copy stream up: the last copy waits
        torch.cuda._sleep(200_000_000)
    crossed = crossing.finish(views, dec.decoded())
    assert not slot.idle()  # fenced while a copy out of it is still to run
    # The current stream waits for the copies: work queued on it now reads every byte.
    assert torch.equal(crossed["u"].cpu(), data)
    assert crossing.copies >= 3
    torch.cuda.synchronize()
    assert slot.idle()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_crossing_never_writes_memory_queued_kernels_still_read() -> None:
    """The strategy drops an update while its kernels are still queued on the default stream;
    the next upload, of the same size, crosses meanwhile: the queued kernels read the old
    values, not the new upload's (the copy stream's memory is its own)."""
    numel = (1 << 20) + 3
    slot = StagingSlot(numel, pin_memory=True)
    crossing = DeviceCrossing(slot, "cuda", step_bytes=1 << 18)
    old = torch.full((numel,), 1.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the default stream stays busy
    read = old * 2.0  # queued behind the sleep
    del old  # freed while the kernel that reads it is still queued
    new = torch.full((numel,), 5.0)
    dec, views = _arrive(slot, crossing, new, 1 << 18)
    crossed = crossing.finish(views, dec.decoded())
    torch.cuda.synchronize()
    assert torch.equal(read, torch.full_like(read, 2.0))
    assert torch.equal(crossed["u"].cpu(), new)
