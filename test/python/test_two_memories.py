"""Host and device are two memories (DESIGN.md §3; issue 28). A value whose home is host memory —
assembled there because it did not fit the device, held there across passes (set_recompute(False)) —
reaches a kernel only through an explicit copy into device memory, counted in the device's peak, and
goes back the same way; stats() counts the bytes and time each way and explain() shows each stage's
transfers with the planner's predicted copy time. The simulated device checks that every kernel operand
is in device memory (the suite runs with LAZYMEM_CHECK_BOUNDARY=1; a simulated capacity turns it on
too), and its copies take the time of a modeled link."""

from __future__ import annotations

import pytest
import torch

import torch_lazymem
from torch_lazymem.testing import parse_bandwidth, simulated_device

MIB = 1 << 20


def matmul_chain(x):
    return ((x @ x).relu() @ x).sum()


def test_a_value_in_host_memory_reaches_mm_through_a_device_copy():
    """The issue's repro (float64, so x is 8 MiB): x is read whole by both matmuls. Under a cap that
    cannot hold x the answer is a lazymem out-of-memory error naming aten::mm — x must be on the device
    whole for a kernel to read it — not a "fit" with an 8 KiB peak read from host memory (what the CPU
    kernel did before, and what failed on CUDA with 'mat2 is on cpu'). Under 12 MiB it fits: eager's
    value, a peak within the cap, x's bytes counted host to device."""
    torch.manual_seed(0)
    xh = torch.randn(1024, 1024, dtype=torch.float64)
    ref = matmul_chain(xh)
    with simulated_device("2MiB"):
        with pytest.raises(torch.OutOfMemoryError, match=r"lazymem: .*aten::mm"):
            matmul_chain(xh.to("lazymem")).item()
    for cap in ("12MiB", "9MiB"):
        torch_lazymem.reset_stats()
        with simulated_device(cap):
            torch.lazymem.reset_peak_memory_stats()
            got = matmul_chain(xh.to("lazymem")).item()
            s = torch_lazymem.stats()
            text = torch_lazymem.explain(print_it=False)
            assert torch.lazymem.max_memory_allocated() <= int(cap[:-3]) * MIB
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), ref)
        assert s["h2d_bytes"] >= xh.nbytes and s["h2d_copies"] >= 1, s
        assert "transfers: 8.00 MiB host to device" in text, text


def test_a_result_assembled_in_host_memory_is_written_out_and_read_back_by_rows():
    """y = tanh(x) is 8 MiB under a 6 MiB device and the user holds it: its chunks are written to host
    memory (device to host) and, in the same pass and in a later plan, read back row by row (host to
    device). Eager's values; peak within the cap; explain() names the value and its bytes."""
    torch.manual_seed(0)
    xh = torch.randn(1024, 1024, dtype=torch.float64)
    with simulated_device("6MiB"):
        torch.lazymem.reset_peak_memory_stats()
        x = xh.to("lazymem")
        y = x.tanh()
        y.sum().item()
        torch_lazymem.reset_stats()
        first = y.cos().sum(0).sum().item()
        s1, text = torch_lazymem.stats(), torch_lazymem.explain(print_it=False)
        torch_lazymem.reset_stats()
        second = (y * 2).sum().item()
        s2 = torch_lazymem.stats()
        assert torch.lazymem.max_memory_allocated() <= 6 * MIB
    ref = xh.tanh()
    torch.testing.assert_close(torch.tensor(first, dtype=torch.float64), ref.cos().sum(0).sum())
    torch.testing.assert_close(torch.tensor(second, dtype=torch.float64), (ref * 2).sum())
    assert s1["values_in_host_memory"] >= 1 and s1["d2h_bytes"] >= ref.nbytes and s1["h2d_bytes"] >= ref.nbytes, s1
    assert "assembled whole in host memory: 8.00 MiB" in text and "8.00 MiB device to host" in text, text
    assert s2["h2d_bytes"] >= ref.nbytes and s2["d2h_bytes"] == 0, s2  # read back by rows, nothing written


@pytest.mark.parametrize("recompute", [True, False])
def test_values_held_in_host_memory_across_passes_cross_the_boundary_both_ways(recompute):
    """set_recompute(False): activations crossing passes are written to host memory (device to host)
    and read back chunk by chunk (host to device); with recompute nothing crosses. Eager's state either
    way, peak within the cap (test_split_recompute checks the same step against eager)."""
    from splitting import sgd_step_where_eager_runs_out
    from test_split_recompute import WideBNNet, recompute_set_to

    torch.manual_seed(0)
    model = WideBNNet().double()
    x, t = torch.randn(64, 3, 16, 16, dtype=torch.float64), torch.randint(0, 10, (64,))
    s, text = sgd_step_where_eager_runs_out(model, x, t, "3MiB", context=lambda: recompute_set_to(recompute))
    if recompute:
        assert s["values_in_host_memory"] == 0 and s["d2h_bytes"] == 0, text
    else:
        assert s["values_in_host_memory"] > 0, text
        assert s["h2d_bytes"] > 0 and s["d2h_bytes"] > 0, s
        assert "transfers:" in text and "device to host" in text, text


def test_the_modeled_link_takes_its_time():
    """Copies on the simulated device take at least bytes / bandwidth (a lower bound the link's clock
    guarantees; nothing is timed against a limit)."""
    torch.manual_seed(0)
    xh = torch.randn(1024, 1024, dtype=torch.float64)
    torch_lazymem.reset_stats()
    with simulated_device("12MiB", link="1GB/s"):
        matmul_chain(xh.to("lazymem")).item()
        s = torch_lazymem.stats()
    moved = s["h2d_bytes"] + s["d2h_bytes"]
    assert moved >= xh.nbytes
    assert s["h2d_ns"] + s["d2h_ns"] >= moved  # 1 GB/s: a byte a nanosecond


def test_link_bandwidths_parse_and_bad_ones_raise():
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("1GiB/s") == float(1 << 30)
    assert parse_bandwidth(None) == 0.0
    assert parse_bandwidth(5e9) == 5e9
    with pytest.raises(ValueError, match="lazymem: link bandwidth must be given per second"):
        parse_bandwidth("25GB")
    with pytest.raises(ValueError, match="lazymem: link bandwidth must be non-negative"):
        parse_bandwidth(-1)
    with pytest.raises(TypeError, match="lazymem: link must be"):
        parse_bandwidth(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lazymem"), simulated_device("1MiB", link="fast/s"):
        pass


def test_a_node_that_fails_leaves_no_device_copy_for_the_next():
    """A kernel that fails (an index out of range, found only when it runs) after its operand was
    copied from host memory: the next node reading another view of the same host-held value gets its
    own copy, not the failed node's. The failure is reported on the value it poisons; the rest is
    eager's."""
    torch.manual_seed(0)
    xh = torch.randn(1024, 1024, dtype=torch.float64)
    with simulated_device("6MiB"):
        y = xh.to("lazymem").tanh()
        y.sum().item()
        y.cos().sum().item()  # y (8 MiB) assembled in host memory
        bad = torch.index_select(y[:4], 0, torch.tensor([7]).to("lazymem"))
        good = y[4:8] * 2
        with pytest.raises((IndexError, RuntimeError), match="lazymem: .*index"):
            torch.lazymem.synchronize()  # one plan runs both: the first fails, the second runs on
        assert "unsplit plan: 3 nodes run" in torch_lazymem.explain(print_it=False)
        got = good.cpu()
        with pytest.raises((IndexError, RuntimeError), match="lazymem: .*index"):
            bad.cpu()
    torch.testing.assert_close(got, xh.tanh()[4:8] * 2)  # (tanh ran split: float64 tolerance)


def item_despite_one_failure(t, failure):
    """t.item() with the `failure`-th allocation failing (fired once): the value, read again after a
    lazymem out-of-memory error when the failure was one it could not absorb."""
    from torch_lazymem.testing import fail_allocation, injected_failures

    fired = injected_failures()
    fail_allocation(failure)
    try:
        got = t.item()
    except torch.OutOfMemoryError as e:
        assert "lazymem" in str(e)
        got = t.item()
    assert injected_failures() == fired + 1
    return got


def held_in_host_memory(xh):
    """y = tanh(x) (as large as x) made under a device that cannot hold it, held by the user:
    assembled in host memory, so later programs read it chunk by chunk across the boundary."""
    y = xh.to("lazymem").tanh()
    y.sum().item()
    y.cos().sum().item()
    return y


def pass_over_held(xh, link, reader):
    """reader(y).sum().item() for y = held_in_host_memory(xh) under a 6 MiB device with `link`: the
    value, and that pass's stats, explain() text and measured peak."""
    with simulated_device("6MiB", link=link):
        y = held_in_host_memory(xh)
        torch_lazymem.reset_stats()
        torch.lazymem.reset_peak_memory_stats()
        got = reader(y).sum().item()
        return got, torch_lazymem.stats(), torch_lazymem.explain(print_it=False), torch.lazymem.max_memory_allocated()


def test_the_next_chunks_rows_cross_while_this_chunk_computes():
    """A pass reading a host-held value (16 MiB under a 6 MiB device) starts copying each chunk's rows
    while the chunk before computes, on the copy worker (DESIGN.md §3): every chunk's rows come in
    ahead; the copy in flight is held in the memory model across the loop, so the measured peak stays
    within the prediction and the cap; eager's value."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    got, s, text, peak = pass_over_held(xh, "1GB/s", lambda y: (y * 2).exp().sin())
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), (xh.tanh() * 2).exp().sin().sum())
    assert s["chunks"] >= 3 and s["h2d_ahead"] == s["chunks"], s
    assert s["h2d_bytes"] == xh.nbytes, s
    assert peak <= s["predicted_peak_bytes"] and peak <= 6 * MIB, (peak, s)
    assert "started a chunk ahead, while the chunk before computes" in text, text


@pytest.mark.parametrize("failure", range(1, 13))
def test_an_allocation_failure_with_a_copy_in_flight_loses_nothing(failure):
    """The n-th allocation fails while copies started ahead are in flight (the chunk runs again
    smaller: copies of rows that no longer come are dropped once they end, and its rows are copied
    again): eager's value, or a lazymem out-of-memory error after which nothing is lost."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    want = (xh.tanh() * 2).exp().sin().sum()
    with simulated_device("6MiB", link="25GB/s"):
        y = held_in_host_memory(xh)
        z = (y * 2).exp().sin().sum()
        got = item_despite_one_failure(z, failure)
        assert torch.lazymem.max_memory_allocated() <= 6 * MIB
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want)


def held_logits_step(device: str, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A float64 MLP whose logits the user holds through backward and the optimizer step (as
    `out = model(x); loss = ...; loss.backward()` does): they must be stored whole."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 256), torch.nn.Tanh()]
    for _ in range(3):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 512)).double().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(1024, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    y = torch.randint(0, 512, (1024,), generator=torch.Generator().manual_seed(2)).to(device)
    kept = []
    for _ in range(steps):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        kept.append(loss.detach().cpu())
    return kept + [logits.detach().cpu()], [p.detach().cpu() for p in model.parameters()]


def test_a_held_result_goes_to_host_memory_where_chunks_cost_more_than_its_copy():
    """Where each node costs a kernel launch per chunk (a GPU: PlanInput::chunk_node_ns, set here on
    the simulated device), the 4 MiB of logits the user holds go to host memory, written out once,
    and the step runs in fewer, larger chunks than with them on the device, where they stay at cost 0
    (the CPU). Either way eager's values and a peak within the budget (issue 30 item 4)."""
    want, want_params = held_logits_step("cpu")
    runs = {}
    # (1 ms per node and chunk: far above any copy's cost, so the choice does not depend on how fast
    # the copies measured so far were: a sanitizer build copies slower)
    for node_ns in (0, 1_000_000):
        torch_lazymem._C._set_chunk_node_ns(node_ns)
        try:
            with simulated_device("12MiB"):
                torch_lazymem.reset_stats()
                got, params = held_logits_step("lazymem")
                runs[node_ns] = (torch_lazymem.stats(), torch_lazymem.explain(print_it=False))
                budget = torch_lazymem.memory_budget()
        finally:
            torch_lazymem._C._set_chunk_node_ns(-1)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(params, want_params)
        stats, text = runs[node_ns]
        assert stats["splits"] > 0 and stats["peak_bytes"] <= budget, stats
        moved = "held in host memory rather than on the device" in text
        assert moved == (node_ns > 0), text
        assert (stats["values_in_host_memory"] > 0) == (node_ns > 0), (stats, text)
    assert runs[1_000_000][0]["chunks"] < runs[0][0]["chunks"], (runs[1_000_000][1], runs[0][1])


def test_a_value_assembled_in_host_memory_goes_out_while_the_next_chunk_computes():
    """y = tanh(x) (16 MiB under a 6 MiB device) is assembled in host memory chunk by chunk, and the
    executor does not wait for each chunk's copy out (DESIGN.md §3): the link carries it while the next
    chunk computes. With the boundary checked (this suite) the bytes land in host memory only when
    something waits for them, as on a real link, so the next program's copies in, the user's read and
    the value's reads on the host are eager's only because each of them waits. Synchronous copies
    (LAZYMEM_ASYNC_COPY_OUT=0) give the same bytes."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    got = {}
    for async_out in (1, 0):
        torch_lazymem._C._set_async_copy_out(async_out)
        try:
            with simulated_device("6MiB", link="1GB/s"):
                torch_lazymem.reset_stats()
                y = held_in_host_memory(xh)
                s = torch_lazymem.stats()
                got[async_out] = (y.cpu(), (y[::3] * 2).sum().item(), s)
        finally:
            torch_lazymem._C._set_async_copy_out(-1)
    (y1, r1, s1), (y0, r0, s0) = got[1], got[0]
    assert s1["values_in_host_memory"] >= 1 and s1["d2h_behind"] == s1["d2h_copies"] >= 3, s1
    assert s1["h2d_bytes"] == 2 * xh.nbytes, s1  # x twice; none of y comes back (rows kept on the device)
    assert s0["d2h_behind"] == 0 and s0["d2h_copies"] == s1["d2h_copies"], s0
    assert torch.equal(y1, y0)  # (elementwise: the same bytes whatever the chunking)
    torch.testing.assert_close(r1, r0)  # (a sum: its chunking may differ between the two runs)
    torch.testing.assert_close(y1, xh.tanh())
    torch.testing.assert_close(torch.tensor(r1, dtype=torch.float64), (xh.tanh()[::3] * 2).sum())


@pytest.mark.parametrize("failure", range(1, 16, 2))
def test_an_allocation_failure_with_copies_out_in_flight_loses_nothing(failure):
    """The n-th allocation of the program that assembles y in host memory fails while earlier chunks'
    copies out are still in flight (the chunk runs again smaller and writes its rows out again, after
    them): eager's value, or a lazymem out-of-memory error after which nothing is lost."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    with simulated_device("6MiB", link="25GB/s"):
        y = xh.to("lazymem").tanh()
        total = y.sum()
        got = item_despite_one_failure(total, failure)
        y.cos().sum().item()
        held = y.cpu()
        assert torch_lazymem.stats()["values_in_host_memory"] >= 1
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), xh.tanh().sum())
    torch.testing.assert_close(held, xh.tanh())


@pytest.mark.parametrize("read", ["same", "view", "strided"])
def test_rows_written_to_host_memory_are_read_again_from_the_device_in_their_chunk(read):
    """A pass assembles y (16 MiB under a 6 MiB device) in host memory and reads it in the same chunk
    (the loss reading logits the user keeps): the reader takes the kernel's result for the chunk's rows
    still on the device (as it is, through another view, or strided), rather than the rows copied out
    and back in; the memory model holds those rows from the writer to the reader, so the measured peak
    is the prediction. Only x's rows cross in; y's go out once; eager's values."""
    reader = {"same": lambda y: y.cos(), "view": lambda y: y.view(-1, 512).cos() * 3,
              "strided": lambda y: y[:, ::2].cos()}[read]
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    with simulated_device("6MiB", link="25GB/s"):
        y = xh.to("lazymem").tanh()
        y.sum().item()  # (y stays pending)
        torch_lazymem.reset_stats()
        torch.lazymem.reset_peak_memory_stats()
        got = reader(y).sum().item()
        s = torch_lazymem.stats()
        peak = torch.lazymem.max_memory_allocated()
        held = y.cpu()
    assert s["values_in_host_memory"] == 1 and s["chunks"] >= 3, s
    assert s["d2h_bytes"] == xh.nbytes and s["h2d_bytes"] == xh.nbytes and s["kept_reads"] == s["chunks"], s
    # Measured within the prediction, and near it: rows counted twice or a reader's release learned as
    # workspace (a chunk's rows of y are 2.7 MiB) would put the prediction far above.
    assert peak <= s["predicted_peak_bytes"] < peak + MIB and peak <= 6 * MIB, (peak, s)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), reader(xh.tanh()).sum())
    torch.testing.assert_close(held, xh.tanh())


SHARED_READERS = {"same": lambda y: y.cos() * y.sin(),
                  "view": lambda y: y.cos() + y.view(-1, 512).sin().view(2048, 1024),
                  "strided": lambda y: y.cos()[:, ::2] * y[:, ::2]}


@pytest.mark.parametrize("read", sorted(SHARED_READERS))
def test_rows_of_a_host_held_value_that_two_nodes_read_cross_once_per_chunk(read):
    """A pass in which two nodes read y's rows (y, 16 MiB under a 6 MiB device, held in host memory):
    the first reader's device copy of the chunk's rows stays on the device through the second, which
    views it (as it is, through another view, or strided) instead of copying the same rows in again
    (KeptRows::read: before, y crossed twice and each read was copied ahead, held across the loop).
    The memory model holds the copy from the first reader through the last, so the measured peak is
    within the prediction and near it; eager's value (11 chunks of 2,048 rows: the last one ragged)."""
    reader = SHARED_READERS[read]
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    got, s, _, peak = pass_over_held(xh, "25GB/s", reader)
    assert s["chunks"] >= 3 and s["h2d_bytes"] == xh.nbytes and s["kept_reads"] == s["chunks"], s
    assert s["h2d_ahead"] == s["chunks"], s  # (the first reader's copies still start a chunk ahead)
    # Within the prediction, and near it (a chunk's rows of y are 1.5 MiB: one copy counted twice, or
    # the copy left out, would show).
    assert peak <= s["predicted_peak_bytes"] < peak + MIB // 2 and peak <= 6 * MIB, (peak, s)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), reader(xh.tanh()).sum())


@pytest.mark.parametrize("failure", range(1, 13))
def test_an_allocation_failure_between_two_reads_of_host_held_rows_loses_nothing(failure):
    """The n-th allocation fails while a chunk holds the first reader's copy of y's rows for the second
    (the chunk runs again smaller and copies its rows again; the kept copy of the failed chunk is not
    read): eager's value, or a lazymem out-of-memory error after which nothing is lost."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    reader = SHARED_READERS["same"]
    with simulated_device("6MiB", link="25GB/s"):
        y = held_in_host_memory(xh)
        got = item_despite_one_failure(reader(y).sum(), failure)
        assert torch.lazymem.max_memory_allocated() <= 6 * MIB
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), reader(xh.tanh()).sum())


@pytest.mark.parametrize("failure", range(1, 16, 2))
def test_an_in_place_update_of_a_host_held_value_that_runs_out_of_memory_is_applied_once(failure):
    """y, held in host memory, is read (b = 3y), updated in place chunk by chunk (each chunk's rows
    copied in, doubled, and copied out without waiting), then the chunk reads b only, and the n-th
    allocation fails: the loop's undo log puts back y's rows only once the copies out into them have
    landed (else the copy landing after the restore doubles them again on the retry)."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    with simulated_device("6MiB", link="25GB/s"):
        y = held_in_host_memory(xh)
        b = y * 3
        y.mul_(2)
        total = b.exp().sum()
        got = item_despite_one_failure(total, failure)
        held = y.cpu()
    torch.testing.assert_close(held, xh.tanh() * 2)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), (xh.tanh() * 3).exp().sum())


def test_an_upload_into_a_host_held_value_lands_after_the_copies_out_before_it():
    """y, held in host memory, is doubled chunk by chunk (copies out not waited for), then half of each
    row is overwritten from a CPU tensor (an upload: written into y's home on the host directly): the
    upload waits for the copies out into y, so none of them lands over it later."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    zh = torch.randn(2048, 512, dtype=torch.float64)
    with simulated_device("6MiB", link="25GB/s"):
        y = held_in_host_memory(xh)
        y.mul_(2)
        y[:, :512].copy_(zh)
        got = y.cpu()
    want = xh.tanh() * 2
    want[:, :512] = zh
    torch.testing.assert_close(got, want)
