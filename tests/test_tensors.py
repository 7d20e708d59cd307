"""The helpers that turn a step's host lists into tensors and send them to the device."""

from __future__ import annotations

import pytest
import torch

from pagedserve.workers.tensors import fill_at, grown, host_tensor, on_device, on_device_packed

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype,values", [
    (torch.long, [0, -1, 2**40, 7]), (torch.int32, [3, -2]), (torch.float32, [0.5, 1, -2.25]),
    (torch.float64, [1e-300, 3]), (torch.bool, [True, False, True]), (torch.bfloat16, [1.5, 2]),
    (torch.long, []), (torch.float32, []),
])
def test_host_tensor_is_torch_tensor(dtype, values):
    t = host_tensor(values, dtype)
    expected = torch.tensor(values, dtype=dtype)
    assert t.dtype == expected.dtype and t.shape == expected.shape and torch.equal(t, expected)
    assert on_device(CPU, values, dtype).tolist() == expected.tolist()


def test_packed_segments_come_back_in_order():
    segments = [torch.tensor([5, 6]), [1, 2, 3], [], [4], torch.arange(3), [], [9]]
    out = on_device_packed(CPU, segments)
    assert [t.tolist() for t in out] == [[5, 6], [1, 2, 3], [], [4], [0, 1, 2], [], [9]]
    assert all(t.dtype == torch.long for t in out)
    storage = out[0].untyped_storage().data_ptr()  # one buffer, hence one copy on CUDA
    assert all(t.untyped_storage().data_ptr() == storage for t in out)


def test_packed_segments_each_start_16_bytes_aligned():
    """Triton specializes kernels on their pointers' 16-byte alignment: a view whose alignment followed the
    lengths before it would compile new kernel variants mid-run."""
    for lengths in [(1, 1, 1), (3, 5, 2, 7), (0, 1, 0, 3), (257, 256, 255)]:
        segments = [list(range(n)) if i % 2 else torch.arange(n) for i, n in enumerate(lengths)]
        out = on_device_packed(CPU, segments)
        assert [t.tolist() for t in out] == [list(range(n)) for n in lengths]
        assert all(t.data_ptr() % 16 == 0 for t in out), [t.data_ptr() % 16 for t in out]


def test_grown_keeps_what_it_held():
    t = torch.tensor([[1, 2], [3, 4]])
    assert grown(t, (1, 2)) is t
    g = grown(t, (3, 2))
    assert g.shape == (4, 2) and g.tolist() == [[1, 2], [3, 4], [0, 0], [0, 0]]


@pytest.mark.parametrize("dtype,value", [(torch.bool, True), (torch.float32, float("-inf")), (torch.int32, 0),
                                         (torch.bfloat16, float("-inf"))])
def test_fill_at_is_assignment_through_index_tensors(dtype, value):
    t = torch.arange(12).reshape(3, 4).to(dtype)
    rows, cols = torch.tensor([0, 2, 2]), torch.tensor([1, 3, 1])
    expected = t.clone()
    expected[rows, cols] = value
    fill_at(t, (rows, cols), value)
    assert torch.equal(t, expected)
    expected[torch.tensor([1])] = value  # whole rows, as one index tensor selects them
    fill_at(t, (torch.tensor([1]),), value)
    assert torch.equal(t, expected)
