"""Issue 48, item 4, held against later changes to the cost model: `auto`, replayed by bench/auto_replay.py on the
figures each 235B lease's stages measured at start, picks what decoded within 0.95x of the fastest in that lease."""
import json
import sys
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
sys.path.insert(0, str(RESULTS.parent))
import auto_replay  # noqa: E402

# one box each: experts ran on the node's figures, the others on the same figures (HYBRID_BENCH_NODE_FIGURES)
LEASES = {
    "h200-2026-12-03c": ("gpu_bench-qwen3-235b-w4a16-experts-h200-2026-12-03c.json",
                         "gpu_bench-qwen3-235b-w4a16-pipeline-h200-2026-12-03c.json",
                         "gpu_bench-qwen3-235b-w4a16-offload-partial-h200-2026-12-03c.json"),
    "h200-2026-12-04": ("gpu_bench-qwen3-235b-w4a16-experts-h200-2026-12-04.json",
                        "gpu_bench-qwen3-235b-w4a16-pipeline-h200-2026-12-04.json"),
}


@pytest.mark.parametrize("lease", sorted(LEASES))
def test_auto_on_a_leases_measured_figures_picks_what_decoded_fastest_there(lease):
    results = [json.loads((RESULTS / name).read_text()) for name in LEASES[lease]]
    measured = auto_replay.decoded(results)
    assert set(measured) == {1, 4, 16, 64} and all({"experts", "pipeline"} <= set(m) for m in measured.values())
    for concurrency, decoded in measured.items():
        pick, predicted = auto_replay.replay(results[0], concurrency, 32, 16)
        assert set(predicted) == {"pipeline", "offload", "experts"}  # balanced and coprocessor refuse W4A16
        assert decoded.get(pick, 0) >= 0.95 * max(decoded.values()), (concurrency, pick, decoded)


def test_the_replay_prints_each_concurrencys_pick_beside_what_was_measured(capsys):
    assert auto_replay.main([str(RESULTS / name) for name in LEASES["h200-2026-12-04"]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"concurrency {c}" for c in (1, 4, 16, 64)]
    assert lines[0].startswith("concurrency 1: auto picks experts (1.00x of the fastest measured, experts 15.44)")
    assert "measured experts 15.44, pipeline 12.19" in lines[0]
