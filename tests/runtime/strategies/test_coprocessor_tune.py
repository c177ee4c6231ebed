"""The coprocessor's split tuned on timed passes (strategies/coprocessor/tune.py): the search and the tables it leaves, against a model of
a node where copy and CPU slow each other down. The passes themselves run on the GPU (tests/gpu, the bench)."""
import pytest
import torch
from vllm_hybrid.strategies.coprocessor import client as coproc_client
from vllm_hybrid.strategies.coprocessor import io as coproc_io
from vllm_hybrid.strategies.coprocessor import shares as coproc_shares
from vllm_hybrid.strategies.coprocessor import tune as coproc_tune


def test_search_walks_to_the_fastest_factor_either_way():
    for best, grid in ((1.0, 1.0), (1.24, 1.24), (0.76, 0.76), (1.3, 1.32), (0.3, 0.52)):  # 1 +- k x 0.08, in range
        got, tried = coproc_tune.search(lambda f: abs(f - best) + 1.0)
        assert got == grid, (best, tried)
    got, tried = coproc_tune.search(lambda f: -f)  # always faster upwards: stops at the range's end
    assert got == max(tried) <= coproc_tune.HIGH and len(tried) < 20


def node(products, copy_gbs, cpu_gbs, calls_ms=0.02, cpu_alone_gbs=None):
    """ms of a pass on a node where the copy reads `copy_gbs` beside the CPU and the CPU `cpu_gbs[rows]` beside the
    copy (lower than either alone: the same DRAM), each split product paying a hand-over; streaming alone 55 GB/s,
    the CPU alone (nothing copied) `cpu_alone_gbs[rows]` (default: as beside the copy)."""
    def timer(rows, n0s):
        copy = sum(n0 * p.cpu.shape[1] * 2 for p, n0 in zip(products, n0s))
        cpu = sum((p.n - n0) * p.cpu.shape[1] * 2 for p, n0 in zip(products, n0s))
        if not cpu:
            return copy / 55e9 * 1e3
        split = sum(n0 < p.n for p, n0 in zip(products, n0s))
        if not copy:
            return cpu / (cpu_alone_gbs or cpu_gbs)[rows] / 1e6 + split * calls_ms
        return max(copy / copy_gbs / 1e6, cpu / cpu_gbs[rows] / 1e6 + split * calls_ms)
    return timer


def split_client(rates, layers=1, shapes=((4096, 4096),)):
    """A client of `layers` streamed layers of `shapes` (layer 0 a boundary layer where there are several), split by
    measured rates: copies 50 GB/s, the CPU `rates` (step size -> GB/s) on every shape."""
    client = coproc_client.Client()
    for layer in range(layers):
        for n, k in shapes:
            client.add_product(torch.empty(n, k, dtype=torch.bfloat16, device="meta"), boundary=layers > 1 and layer == 0,
                               layer=layer)
    client.measured = {"copy_gbs": 50.0, "products_gbs": {coproc_shares.shape_key(n, k): {str(r): v for r, v in rates.items()}
                                                          for n, k in shapes}}
    client.split_by_measured()
    return client


def test_tuning_moves_the_split_to_where_copy_and_cpu_end_together_and_streams_where_that_wins():
    # solo rates: copies 50 GB/s, the CPU 50 at 1-16 rows: an even split; compute-bound at 64 (still worth a split)
    client = split_client({1: 50.0, 4: 50.0, 16: 50.0, 64: 12.0}, layers=4, shapes=((6144, 4096), (4096, 14336)))
    assert {s for table in client.tables().values() for _, s in table} == {0.5, 0.806}
    # together: the copy keeps 45, the CPU drops to 30 at 1 and 4, 20 at 16, 4 at 64
    tuned = coproc_tune.tune(client, 2, node(client.products, 45.0, {1: 30.0, 4: 30.0, 16: 20.0, 64: 4.0}))
    # the GPU's share grows toward 45 / (45 + 30) = 0.6 at 1 and 4 rows, and more at 16 (45 / 65 = 0.69)
    assert 0.56 <= tuned.factors[1] * 0.5 <= 0.64 and tuned.factors[4] == tuned.factors[1]
    assert 0.65 <= tuned.factors[16] * 0.5 <= 0.73
    assert tuned.pass_ms[1] < tuned.tried[1][1.0] and all(tuned.pass_ms[r] < tuned.stream_ms for r in (1, 4, 16))
    # at 64 the CPU adds less than its hand-overs cost: streamed, as the offloader alone would
    assert 64 not in tuned.factors and 64 in tuned.tried
    qkv, down = client.products[2], client.products[3]
    assert [b for b, _ in qkv.table] == [1, 4, 16] and client.n0(2, 64) is None and client.n0(2, 17) is None
    assert client.n0(2, 1) == coproc_shares.rows_of(qkv.n, tuned.factors[1] * 0.5)
    assert client.n0(3, 16) == coproc_shares.rows_of(down.n, tuned.factors[16] * 0.5)
    # the boundary layer's rows follow the tuned one-token share
    assert client.products[0].n0_fixed == coproc_shares.rows_of(qkv.n, tuned.factors[1] * 0.5)
    assert "1 rows: x" in tuned.summary() and "64 rows: not split" in tuned.summary()
    assert tuned.summary().endswith(f"; streaming every row {tuned.stream_ms:.1f} ms")


def test_streaming_every_row_is_timed_once_at_the_smallest_step():
    """Streaming is copy-bound at every step size the split serves: one timing (its fastest) stands for all."""
    client = split_client({1: 50.0, 4: 50.0, 16: 50.0}, layers=2)
    model, streamed = node(client.products, 45.0, {1: 30.0, 4: 30.0, 16: 20.0}), []

    def timer(rows, n0s):
        if n0s == [p.n for p in client.products]:
            streamed.append(rows)
            return 100.0 + rows  # more GPU compute at larger steps
        return model(rows, n0s)
    tuned = coproc_tune.tune(client, 1, timer)
    assert streamed == [1] and tuned.stream_ms == 101.0 and sorted(tuned.tried) == [1, 4, 16]


def test_a_node_where_the_split_never_pays_streams_every_step():
    client = split_client({1: 40.0, 4: 40.0})
    tuned = coproc_tune.tune(client, 1, node(client.products, 20.0, {1: 2.0, 4: 2.0}, calls_ms=1.0))
    assert tuned.factors == {} and client.tables() == {"4096x4096": []} and client.n0(0, 1) is None


def test_tuning_is_on_for_a_measured_split_and_asked_for_a_forced_one(monkeypatch):
    monkeypatch.delenv(coproc_io.TUNE_ENV, raising=False)
    assert coproc_client.tune_split(forced=False) and not coproc_client.tune_split(forced=True)
    monkeypatch.setenv(coproc_io.TUNE_ENV, "1")
    assert coproc_client.tune_split(forced=True)
    monkeypatch.setenv(coproc_io.TUNE_ENV, "0")
    assert not coproc_client.tune_split(forced=False)
    monkeypatch.setenv(coproc_io.TUNE_ENV, "yes")
    with pytest.raises(ValueError, match="HYBRID_COPROC_TUNE='yes'"):
        coproc_client.tune_split(forced=False)


def test_a_box_growing_faster_during_the_search_does_not_move_the_split():
    """Passes 1.5% faster at each timing whatever the split (DRAM still settling): the search walks away from x1, and
    its pick, timed again right before x1, is no longer faster, so the measured split stands. A real gain survives."""
    for gain, moved in ((0.0, False), (0.2, True)):
        client = split_client({1: 50.0})
        calls = []

        def timer(rows, n0s, gain=gain):
            calls.append(rows)
            gpu = n0s[0] / 4096
            return 100.0 * 0.985 ** len(calls) - 100 * gain * gpu if gpu < 1 else 200.0

        tuned = coproc_tune.tune(client, 1, timer)
        pick = min(tuned.tried[1], key=tuned.tried[1].get)
        assert pick > 1.0 and set(tuned.again[1]) == {pick, 1.0}  # the search itself was fooled both times
        assert (tuned.factors[1] == pick) is moved and (tuned.factors[1] == 1.0) is not moved, tuned.summary()
        assert client.n0(0, 1) == coproc_shares.rows_of(4096, 0.5 * tuned.factors[1])


def test_a_cpu_fast_alone_but_starved_beside_the_copy_takes_every_row_of_small_steps():
    """The CPU reads 100 GB/s alone but 30 beside a copy taking 45 (the copy engine wins the DRAM): at 1 and 4 rows no
    copy at all is faster than any split, so those steps give the CPU every row (share 0: nothing prefetched, the
    boundary layers' rows too); at 16 rows the CPU is compute-bound (20 GB/s alone), a split wins and is kept."""
    client = split_client({1: 100.0, 4: 100.0, 16: 20.0}, layers=4, shapes=((6144, 4096), (4096, 14336)))
    tuned = coproc_tune.tune(client, 2, node(client.products, 45.0, {1: 30.0, 4: 30.0, 16: 15.0},
                                             cpu_alone_gbs={1: 100.0, 4: 100.0, 16: 20.0}))
    assert tuned.cpu_only == {1, 4} and 16 not in tuned.cpu_only_ms  # at 16 the CPU alone is far too slow to time
    assert tuned.pass_ms[1] < 0.8 * min(tuned.tried[1].values())
    assert [client.n0(j, 1) for j in range(8)] == [0] * 8 and client.products[0].n0_fixed == 0
    assert client.n0(2, 4) == 0 and 0 < client.n0(2, 16) < client.products[2].n
    assert "1 rows: CPU only" in tuned.summary() and "16 rows: x" in tuned.summary()


def test_the_cpu_alone_is_timed_only_where_its_solo_rates_could_win():
    client = split_client({1: 40.0})
    asked = []

    def timer(rows, n0s):
        asked.append(n0s[0])
        return node(client.products, 45.0, {1: 35.0}, cpu_alone_gbs={1: 40.0})(rows, n0s)

    tuned = coproc_tune.tune(client, 1, timer)
    assert 0 not in asked and not tuned.cpu_only_ms  # alone 40 against 45 + 35 together: not worth a pass


def test_a_cpu_only_pass_that_was_fast_once_does_not_replace_the_split():
    """The CPU-only pass timed faster once (a box still settling), then no faster than the split timed after it: the
    split stays; timed faster again, it goes."""
    for later_ms, kept in ((95.0, False), (80.0, True)):
        client = split_client({1: 50.0})
        cpu_only_passes = []

        def timer(rows, n0s, later_ms=later_ms):
            if n0s[0] == 4096:
                return 200.0  # streaming
            if n0s[0] == 0:
                cpu_only_passes.append(1)
                return 80.0 if len(cpu_only_passes) == 1 else later_ms
            return 90.0 + abs(n0s[0] / 4096 - 0.5)  # the split, fastest as measured

        tuned = coproc_tune.tune(client, 1, timer)
        assert len(cpu_only_passes) == 2 and (tuned.cpu_only == {1}) is kept, tuned.summary()
        assert (client.n0(0, 1) == 0) is kept


def test_a_cpu_only_pass_that_streaming_still_beats_is_not_kept():
    """At 4 rows the CPU starves beside the copy (2 GB/s) and alone (40 GB/s) beats any split, but streaming every row
    (55 GB/s) beats both: that size streams, and what was timed still reads back (the summary once raised here)."""
    client = split_client({1: 50.0, 4: 50.0})
    tuned = coproc_tune.tune(client, 1, node(client.products, 45.0, {1: 30.0, 4: 2.0},
                                             cpu_alone_gbs={1: 30.0, 4: 40.0}))
    assert 4 in tuned.cpu_only_ms and tuned.cpu_only_ms[4] > tuned.stream_ms
    assert 4 not in tuned.cpu_only and 4 not in tuned.factors and client.n0(0, 4) is None and client.n0(0, 1) > 0
    assert "4 rows: not split (CPU only" in tuned.summary()


def test_steps_sgl5_computes_alike_are_tuned_once():
    """sgl5 computes steps of 1-4 rows as 5 and the copy moves the same rows: the search at one row stands for four
    (two searches over the same work can pick two factors on a drifting box); torch's GEMM tunes each size."""
    for kernel, searched in (("sgl5", [1, 16]), ("torch", [1, 4, 16])):
        client = split_client({1: 50.0, 4: 50.0, 16: 50.0}, layers=2)
        client.measured["kernel"] = kernel
        model, timed = node(client.products, 45.0, {1: 30.0, 4: 20.0, 16: 20.0}), set()

        def timer(rows, n0s):
            timed.add(rows)
            return model(rows, n0s)
        tuned = coproc_tune.tune(client, 1, timer)
        assert sorted(timed) == searched, kernel
        if kernel == "sgl5":
            assert tuned.same_as == {4: 1} and tuned.factors[4] == tuned.factors[1] > 1.0
            assert client.n0(1, 4) == client.n0(1, 1) and "4 rows: as 1 (the same pass" in tuned.summary()
        else:  # the CPU slower at 4 rows in this model: more of them to the GPU
            assert tuned.same_as == {} and tuned.factors[4] > tuned.factors[1]
