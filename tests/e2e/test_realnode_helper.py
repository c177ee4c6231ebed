"""realnode.RealNode.node_up: ../shared/node's node-up.sh once more when it gives up a daemon as "exited" (stop 51's
CI: CoreDNS printed its banner after node-up had declared it gone; node-up.sh is idempotent), and not otherwise."""
import os

import pytest
import realnode


def node_with(tmp_path, monkeypatch, script: str) -> realnode.RealNode:
    (tmp_path / "node-up.sh").write_text(script)
    monkeypatch.setattr(realnode, "NODE_SCRIPTS", tmp_path)
    node = realnode.RealNode.__new__(realnode.RealNode)  # no control plane: only the script is run
    node.env, node.times = {"PATH": os.environ["PATH"], "RUNS": str(tmp_path / "runs")}, {}
    return node


def runs(tmp_path) -> int:
    return len((tmp_path / "runs").read_text().split())


def test_a_daemon_given_up_as_exited_gets_a_second_node_up(tmp_path, monkeypatch):
    node = node_with(tmp_path, monkeypatch, 'echo x >> "$RUNS"\n[ "$(wc -l < "$RUNS")" -gt 1 ] || '
                                            '{ echo "[node-up] ERROR: coredns exited" >&2; exit 1; }\n')
    node.node_up()
    assert runs(tmp_path) == 2 and node.times["node-up reruns"] == 1


def test_other_failures_and_a_second_exit_fail_the_node(tmp_path, monkeypatch):
    node = node_with(tmp_path, monkeypatch, 'echo x >> "$RUNS"; echo "[node-up] ERROR: missing kubelet" >&2; exit 1\n')
    with pytest.raises(AssertionError, match="missing kubelet"):
        node.node_up()
    assert runs(tmp_path) == 1
    node = node_with(tmp_path, monkeypatch, 'echo x >> "$RUNS"; echo "[node-up] ERROR: coredns exited" >&2; exit 1\n')
    (tmp_path / "runs").unlink()
    with pytest.raises(AssertionError, match="coredns exited"):
        node.node_up()
    assert runs(tmp_path) == 2
