"""bench/: every strategy in a comparison runs with the CPU kernel this box measured (issue 48, item 0): a
cpu_kernels.json measured on another machine is measured again by bench/run.sh and refused by bench/gpu_bench.py."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cpu_kernels  # noqa: E402
import gpu_bench  # noqa: E402


def kernels_file(path: Path, machine: dict) -> None:
    ms = lambda x: {str(m): {"ms": x * m} for m in (1, 4, 16, 64)}  # noqa: E731
    path.write_text(json.dumps({"machine": machine, "placements": {
        "all": {"cpu_list": [1, 2, 3], "kernels": {"onednn": ms(2.0), "sgl": ms(1.0)}}}}))


def test_a_kernel_pick_measured_on_another_machine_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_bench, "OUT", tmp_path)
    here = cpu_kernels.machine()
    assert set(here) == {"boot_id", "cpu", "cpus"} and here["boot_id"]
    kernels_file(tmp_path / "cpu_kernels.json", {**here, "boot_id": "another lease"})
    assert not cpu_kernels.measured_here(str(tmp_path / "cpu_kernels.json"))
    with pytest.raises(SystemExit, match="measured on another machine"):
        gpu_bench.cpu_tuning()
    kernels_file(tmp_path / "cpu_kernels.json", here)
    assert cpu_kernels.measured_here(str(tmp_path / "cpu_kernels.json"))
    assert gpu_bench.cpu_tuning() == {"kernel": "sgl", "placement": "all",
                                      "env": {"HYBRID_CPUS": "1,2,3", "VLLM_CPU_SGL_KERNEL": "1"}}


def test_run_sh_measures_every_lease_and_the_file_says_which_machine(tmp_path, capsys):
    """bench/run.sh calls cpu_kernels.py whatever is on disk; it keeps only a file of this machine's."""
    run_sh = (Path(__file__).resolve().parents[2] / "bench" / "run.sh").read_text()
    line = next(ln for ln in run_sh.splitlines() if "bench/cpu_kernels.py" in ln and "python3" in ln)
    assert not line.lstrip().startswith("[") and "|| exit 1" in line  # no "[ -f ... ] ||" short-cut
    kernels_file(tmp_path / "k.json", cpu_kernels.machine())
    cpu_kernels.main(str(tmp_path / "k.json"), None)
    assert "measured on this machine already" in capsys.readouterr().out
