"""The CPU pods' servers' shared loop (cpupod_server.wait_request): spin while a step is in flight, nap once idle."""
import threading
import time

import torch
from vllm_hybrid.cpupod.server import Counters, wait_request
from vllm_hybrid.strategies.experts.kernels import Served


def waited(words, idle_s: float, **kw) -> dict:
    """wait_request in a thread, the request word raised after idle_s: its result, CPU and wall time, and how long
    after the raise it returned."""
    got = {}

    def waiter():
        cpu, wall = time.thread_time(), time.monotonic()
        got["word"] = wait_request(words, lambda: False, idle_check=0.05, **kw)
        got["returned"] = time.monotonic()
        got["cpu"], got["wall"] = time.thread_time() - cpu, got["returned"] - wall

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(idle_s)
    raised = time.monotonic()
    words[0] = 7
    t.join(10)
    assert not t.is_alive()
    return {**got, "answer_s": got["returned"] - raised}


def test_an_idle_server_naps_and_still_answers_at_once():
    got = waited(torch.zeros(4, dtype=torch.int64), 1.5, nap_after=0.1)
    assert got["word"] == 7
    assert got["cpu"] < 0.5 * got["wall"], got  # it spun about 0.15 s of the 1.5, then napped
    assert got["answer_s"] < 0.05, got  # a nap is 0.2 ms


def test_a_server_between_products_keeps_spinning():
    got = waited(torch.zeros(4, dtype=torch.int64), 0.5, nap_after=10.0)  # idle less than nap_after: no nap
    assert got["word"] == 7
    assert got["cpu"] > 0.3 * got["wall"], got


def test_a_scrape_waits_for_the_step_in_progress_and_sees_it_whole():
    """Counters read under the server's lock: a scrape while a step holds it waits and then sees both totals
    updated, never one of them (a torn pair made the experts' remote share 0.478 instead of 0.5)."""
    served = Served()
    counters = Counters({"stage": "1"}, [("tokens", "", lambda: served.expert_tokens),
                                         ("pairs", "", lambda: served.routed_pairs)], lock=served.lock)
    scraped = []
    with served.lock:
        served.expert_tokens += 3
        scrape = threading.Thread(target=lambda: scraped.extend(counters.collect()))
        scrape.start()
        scrape.join(0.2)
        assert scrape.is_alive() and not scraped  # half a step is never read
        served.routed_pairs += 6
    scrape.join(5)
    assert [(f.name, f.samples[0].value) for f in scraped] == [("tokens", 3), ("pairs", 6)]


def test_the_dram_figure_is_the_faster_of_a_sum_and_a_max(monkeypatch):
    """The node's start figure and the bench's bound read DRAM the same way: a box where the uint8 max reads slower
    than a float32 sum (65-81 against 89-107 GB/s on the H100 boxes) gets the sum's figure, and the reverse."""
    from vllm_hybrid.cpupod import server
    monkeypatch.setattr(server, "measure_dram_read", lambda flat, nbytes: 1e-3)
    summed = server.measure_dram(16 << 20)
    assert summed > 1e-3
    monkeypatch.setattr(server, "measure_dram_read", lambda flat, nbytes: 1e6)
    assert server.measure_dram(16 << 20) == 1e6
