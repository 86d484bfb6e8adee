"""restore_tensor, the one way a strategy's load_state_dict copies a saved tensor back."""

import torch

from aggsrv.strategies.state_copy import SharedCopies, restore_tensor


def test_a_plain_restore_is_a_fresh_copy_in_the_asked_dtype() -> None:
    saved = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    out = restore_tensor(saved, torch.device("cpu"))
    assert out.dtype == torch.float32 and torch.equal(out, saved.float())
    out[0, 0] = 99.0
    assert saved[0, 0] == 0.0  # its own memory
    assert restore_tensor(None, torch.device("cpu")) is None
    wide = restore_tensor(saved.float(), torch.device("cpu"), torch.float64)
    assert wide.dtype == torch.float64 and torch.equal(wide, saved)


def test_a_restore_through_shared_copies_shares_what_was_shared() -> None:
    base = torch.arange(8, dtype=torch.float32)
    first, second = base[:4], base[4:]
    copies = SharedCopies(torch.device("cpu"))
    a = restore_tensor(first, torch.device("cpu"), copy=copies)
    b = restore_tensor(second, torch.device("cpu"), copy=copies)
    assert torch.equal(a, first) and torch.equal(b, second)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
