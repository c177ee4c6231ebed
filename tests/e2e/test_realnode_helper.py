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


def test_a_second_run_waits_for_the_node_and_takes_it_when_the_first_goes(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(realnode, "CACHE", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; sys.path[:0] = [sys.argv[1]]; "
                               "fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
                               "print('held', flush=True); time.sleep(60)",
                               str(tmp_path), str(tmp_path / "node.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AssertionError, match="another run on this machine held the real node"):
            realnode.hold_the_node(wait_s=1)
    finally:
        holder.kill()
        holder.wait()
    os.close(realnode.hold_the_node(wait_s=1))  # a killed holder leaves no lock


def test_a_killed_runs_daemons_are_stopped_and_containerd_left_to_node_down(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(realnode, "CACHE", tmp_path)
    monkeypatch.setattr(realnode, "NODE_SCRIPTS", tmp_path)
    (tmp_path / "node-down.sh").write_text('echo ran > "$RUNS"\n')
    state = tmp_path / "node"
    (state / "pids").mkdir(parents=True)
    started = {name: subprocess.Popen(["bash", "-c", f'exec -a "{name} {state}/conf/{name}.yaml" sleep 60'])
               for name in ("kubelet", "containerd --config")}
    started["reused pid"] = subprocess.Popen(["sleep", "60"])  # a pid file whose process is no node daemon now
    try:
        for name, proc in started.items():
            (state / "pids" / f"{name.split()[0]}.pid").write_text(str(proc.pid))
        realnode.stop_a_killed_runs_node({"PATH": os.environ["PATH"], "RUNS": str(tmp_path / "runs")})
        assert started["kubelet"].wait(timeout=10) == -9
        assert started["containerd --config"].poll() is None  # node-down.sh removes its containers first
        assert started["reused pid"].poll() is None
        assert (tmp_path / "runs").read_text() == "ran\n"
    finally:
        for proc in started.values():
            proc.kill()


def test_a_half_written_image_layout_falls_back_to_the_whole_archive_and_is_cleared(tmp_path, monkeypatch):
    """import_delta_or_whole: with buildah's store unreadable, the OCI layout a killed run left half written (its index.json cut short) loses nothing
    but time: the image goes in as the whole streamed archive, and the layout is cleared for the next build."""
    monkeypatch.setattr(realnode, "CACHE", tmp_path)
    layout = tmp_path / "oci" / "runtime-cpu"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "index.json").write_text('{"schemaVersion": 2, "manifests": [{"mediaType"')
    pushed = []
    monkeypatch.setattr(realnode, "run", lambda cmd, *a, **k: pushed.append(cmd[:2]) or "")  # buildah push: left as is
    node = realnode.RealNode.__new__(realnode.RealNode)
    monkeypatch.setattr(node, "import_streamed", lambda image_id, ref: f"whole archive of {image_id} as {ref}")

    def store_gone(image_id, ref):
        raise FileNotFoundError("buildah's store has no image abc")
    monkeypatch.setattr(node, "import_from_store", store_gone)
    how = node.import_delta_or_whole("abc", "localhost/hybrid-inference/runtime-cpu:dev")
    assert pushed == [["buildah", "push"]]
    assert how.startswith("whole archive of abc as localhost/hybrid-inference/runtime-cpu:dev (failed: from the store: "
                          "buildah's store has no image abc; the delta: ")
    assert not layout.exists()
