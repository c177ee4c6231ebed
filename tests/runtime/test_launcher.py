import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from test_planner import LLAMA_8B
from vllm_hybrid.cpubind import plan_binding
from vllm_hybrid.identity import identity_from_env
from vllm_hybrid.launcher import numactl_prefix, resolve_stage, vllm_command, vllm_env
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import model_shape, split_layers
from vllm_hybrid.plugin import UnsupportedVllmVersion, check_vllm_version
from vllm_hybrid.stage_metrics import scrape_text

PLAN = {"model": "/models/llama", "served_model_name": "llama", "dtype": "bfloat16", "max_model_len": 8192,
        "api_port": 8000, "master_port": 29500, "extra_args": ["--seed", "7"],
        "stages": [{"name": "gpu", "device": "gpu", "layers": 16, "gpu_memory_utilization": 0.8},
                   {"name": "cpu", "device": "cpu", "layers": 16, "cpus": 16, "memory": "64Gi"}]}


def build(stage, env=None):
    plan = plan_from_dict(PLAN)
    split = split_layers(plan, model_shape(LLAMA_8B))
    ident = identity_from_env({"HYBRID_MASTER_ADDR": "x-gpu-{replica}.x-peers", "HYBRID_REPLICA": "2",
                               "HYBRID_HOST_IP": "10.0.0.5", **(env or {})}, stage=stage)
    binding = plan_binding(list(range(16)), {0: list(range(16))}) if plan.stages[stage].is_cpu else None
    rec = resolve_stage(plan, split, ident, {"PATH": "/bin"})
    return vllm_command(plan, rec, ident, python="py"), vllm_env(plan, rec, ident, binding, {"PATH": "/bin"}), binding


def _built(stage):
    plan = plan_from_dict(PLAN)
    ident = identity_from_env({"HYBRID_MASTER_ADDR": "m"}, stage=stage)
    split = split_layers(plan, model_shape(LLAMA_8B))
    return plan, resolve_stage(plan, split, ident, {}), ident, plan_binding(list(range(16)), {0: list(range(16))})


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_head_stage_serves_api_on_gpu():
    argv, env, _ = build(0)
    assert argv[:5] == ["py", "-m", "vllm_hybrid.vllm_entry", "serve", "/models/llama"]
    assert flag(argv, "--node-rank") == "0" and flag(argv, "--nnodes") == "2"
    assert flag(argv, "--master-addr") == "x-gpu-2.x-peers" and flag(argv, "--master-port") == "29500"
    assert flag(argv, "--port") == "8000" and "--headless" not in argv
    assert flag(argv, "--middleware") == "vllm_hybrid.api_guard.RequestGuard"
    assert flag(argv, "--gpu-memory-utilization") == "0.8"
    assert flag(argv, "--block-size") == "128" and flag(argv, "--max-num-seqs") == "64"
    assert "--no-async-scheduling" in argv and argv[-2:] == ["--seed", "7"]
    assert env["VLLM_PP_LAYER_PARTITION"] == "16,16" and env["HYBRID_PIPELINE"] == "1"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["VLLM_HOST_IP"] == "10.0.0.5"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "CUDA_VISIBLE_DEVICES" not in env


def test_cpu_stage_is_headless_with_cpu_env():
    argv, env, binding = build(1)
    assert "--headless" in argv and "--port" not in argv and flag(argv, "--node-rank") == "1"
    assert "--gpu-memory-utilization" not in argv
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-14" == binding.omp_bind
    # 64Gi - 3Gi runtime reserve - 16 layers (6.5 GiB) - LM head (0.98 GiB) -> 53 whole GiB of KV
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "53"
    assert env["HYBRID_LAYER_RANGE"] == "16-31"
    assert env["VLLM_CPU_SGL_KERNEL"] == "1" and env["HYBRID_BATCHES_IN_FLIGHT"] == "1"
    assert build(1, env={})[1]["HYBRID_PIPELINE_RANK"] == "1"
    assert vllm_env(*_built(1), {"VLLM_CPU_SGL_KERNEL": "0"})["VLLM_CPU_SGL_KERNEL"] == "0"  # a stage may opt out
    # weights on transparent huge pages (cpubind.THP_ENV) unless the stage's env says otherwise; not the GPU stage's
    assert env["THP_MEM_ALLOC_ENABLE"] == "1" and "THP_MEM_ALLOC_ENABLE" not in build(0)[1]
    assert vllm_env(*_built(1), {"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"
    # the API stage's guard gets the model's vocabulary (it refuses token ids past it); a headless one has no API
    assert "HYBRID_VOCAB_SIZE" not in env and build(0)[1]["HYBRID_VOCAB_SIZE"] == str(LLAMA_8B["vocab_size"])


def test_a_stages_own_kv_cache_size_wins_and_a_bad_one_is_refused():
    plan = plan_from_dict(PLAN)
    split, ident = split_layers(plan, model_shape(LLAMA_8B)), identity_from_env({"HYBRID_MASTER_ADDR": "m"}, stage=1)
    rec = resolve_stage(plan, split, ident, {"VLLM_CPU_KVCACHE_SPACE": "20"})
    assert rec.kv_cache_gib == 20  # less than the planned 53: more room for the rest
    assert vllm_env(plan, rec, ident, plan_binding([0, 1], {0: [0, 1]}), {})["VLLM_CPU_KVCACHE_SPACE"] == "20"
    assert resolve_stage(plan, split, ident, {"VLLM_CPU_KVCACHE_SPACE": "53"}).kv_cache_gib == 53
    # more than the stage's memory holds: refused at start, not OOM-killed after minutes of loading
    with pytest.raises(PlanError, match=r"VLLM_CPU_KVCACHE_SPACE=54 GiB: stage cpu's memory \(64 GiB\) leaves 53 GiB"):
        resolve_stage(plan, split, ident, {"VLLM_CPU_KVCACHE_SPACE": "54"})
    for bad in ("0", "4GiB", "-1"):
        with pytest.raises(PlanError, match="VLLM_CPU_KVCACHE_SPACE: expected whole GiB"):
            resolve_stage(plan, split, ident, {"VLLM_CPU_KVCACHE_SPACE": bad})


def test_a_cpu_stage_pins_only_cores_that_are_its_own(caplog):
    """The static CPU manager gives a Guaranteed stage exactly its cores: pinned there. A wider cpuset (CPU
    manager `none`, most clusters) is shared by every pod of the node: threads float, as many as requested
    (pinning there put both stages of a two-CPU node on CPU 0)."""
    from vllm_hybrid.cli import stage_binding
    from vllm_hybrid.cpubind import unpinned_binding
    plan = plan_from_dict(PLAN)
    ident = identity_from_env({"HYBRID_MASTER_ADDR": "m"}, stage=1)
    own = stage_binding(plan, ident, {"HYBRID_CPUS": "4-19"})
    assert own.pinned and own.omp_bind == "4-18"  # one of 16 left to the engine loop
    with caplog.at_level("WARNING"):
        shared = stage_binding(plan, ident, {"HYBRID_CPUS": "0-63"})
    assert not shared.pinned and shared.threads_per_rank == 16 and shared.omp_bind == "nobind"
    assert "cpuset 0-63 is shared" in caplog.text and "threads not pinned, 16 OpenMP threads" in caplog.text
    env = vllm_env(*_built(1)[:3], shared, {})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "16"
    assert "HYBRID_FORK_WORKER" not in env  # several threads: vLLM spawns the worker with its own OpenMP setup
    # one thread, pinned or floating: the worker is forked (vllm_patches.cpu.patch_cpu_worker_fork), one thread stage-wide
    for one in (stage_binding(plan, ident, {"HYBRID_CPUS": "3"}), unpinned_binding([0, 1], 1)):
        env = vllm_env(*_built(1)[:3], one, {})
        assert env["HYBRID_FORK_WORKER"] == "1" and env["OMP_NUM_THREADS"] == "1"
    from vllm_hybrid.launcher import binding_cpus
    from vllm_hybrid.strategies.base import server_env
    assert binding_cpus(shared) == "unpinned: 16 threads over 0-63" and binding_cpus(own) == "4-18"
    assert "GOMP_CPU_AFFINITY" not in server_env(shared, {}, 1, "cpu")


def test_same_settings_pinned_on_every_stage():
    a, _, _ = build(0)
    b, _, _ = build(1)
    for name in ("--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--dtype",
                 "--pipeline-parallel-size", "--tensor-parallel-size", "--served-model-name"):
        assert flag(a, name) == flag(b, name), name


def test_identity_from_env():
    assert identity_from_env({"HYBRID_STAGE": "1", "HYBRID_REPLICA": "3"}).replica == 3
    with pytest.raises(PlanError, match="HYBRID_STAGE"):
        identity_from_env({})
    with pytest.raises(PlanError, match="HYBRID_REPLICA"):
        identity_from_env({"HYBRID_STAGE": "0", "HYBRID_REPLICA": "x"})


def test_numactl_only_with_several_nodes():
    multi = plan_binding(list(range(8)), {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})
    assert numactl_prefix(multi, "/usr/bin/numactl") == ["/usr/bin/numactl", f"--membind={multi.numa_node}"]
    assert numactl_prefix(multi, None) == []
    assert numactl_prefix(plan_binding([0, 1], {0: [0, 1]}), "/usr/bin/numactl") == []


def test_version_check():
    check_vllm_version("0.26.0")
    check_vllm_version("0.26.0+cpu")
    with pytest.raises(UnsupportedVllmVersion, match="supports vLLM 0.26.0 only.*0.27.1"):
        check_vllm_version("0.27.1")


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "vllm_hybrid.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_dry_run_and_errors(tiny_llama, tmp_path):
    plan = {**PLAN, "model": str(tiny_llama), "dtype": "float32", "max_model_len": 512,
            "stages": [{"name": "a", "device": "cpu", "cpus": 1, "memory": "4Gi"},
                       {"name": "b", "device": "cpu", "cpus": 1, "memory": "4Gi"}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    r = run_cli("serve", "--plan", str(path), "--stage", "1", "--dry-run")
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout.split("vllm-hybrid resolved ", 1)[1].splitlines()[0])
    assert resolved["role"] == "headless" and resolved["partition"] == "2,2"
    r = run_cli("plan", "--plan", str(path))
    assert r.returncode == 0 and "VLLM_PP_LAYER_PARTITION=2,2" in r.stdout
    r = run_cli("serve", "--plan", str(path), "--stage", "5")
    assert r.returncode == 2 and "stage: 5 is out of range" in r.stderr
    path.write_text(yaml.safe_dump({**plan, "stages": plan["stages"][:1] + [{"name": "b", "device": "cpu"}]}))
    r = run_cli("serve", "--plan", str(path), "--stage", "0")
    assert r.returncode == 2 and "stages[1].cpus: required" in r.stderr
    path.write_text(yaml.safe_dump({**plan, "model": str(tmp_path / "nope")}))
    r = run_cli("plan", "--plan", str(path))
    assert r.returncode == 2 and "missing model files" in r.stderr


def test_stage_left_out_by_offload_idles_with_metrics(tiny_llama, tmp_path):
    from vllm_hybrid.local import free_port
    port = free_port()
    plan = {**PLAN, "model": str(tiny_llama), "dtype": "float32", "max_model_len": 512, "strategy": "offload",
            "stages": [{"name": "gpu", "device": "gpu", "layers": 2}, {"name": "cpu", "device": "cpu", "layers": 2,
                                                                      "cpus": 1, "memory": "4Gi"}]}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    env = {**os.environ, "HYBRID_METRICS_PORT": str(port), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "vllm_hybrid.cli", "serve", "--plan", str(tmp_path / "plan.yaml"),
                             "--stage", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = ""
        for _ in range(100):
            try:
                text = scrape_text(f"http://127.0.0.1:{port}/metrics", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        assert 'device="unused"' in text and 'strategy="offload"' in text and 'stage="1"' in text
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "not used under strategy offload" in out


def test_a_balanced_gpu_stage_leaves_its_helper_room_on_the_gpu():
    from vllm_hybrid.strategies import resolve_split
    from vllm_hybrid.strategies.balanced import helper_gpu_bytes
    raw = {**PLAN, "strategy": "balanced", "max_num_batched_tokens": 4096}
    raw["stages"] = [dict(PLAN["stages"][0], memory="80Gi"), PLAN["stages"][1]]
    plan = plan_from_dict(raw)
    split, lay, _ = resolve_split(plan, model_shape(LLAMA_8B))
    ident = identity_from_env({"HYBRID_MASTER_ADDR": "m"}, stage=0)
    argv = vllm_command(plan, resolve_stage(plan, split, ident, {}, lay), ident, python="py")
    share = 0.8 - helper_gpu_bytes(plan, model_shape(LLAMA_8B), 0) / (80 << 30)
    # GPU first: the cpu stage holds the LM head, the biggest weight, so each ring slot is that big
    assert 0.6 < share < 0.7 and flag(argv, "--gpu-memory-utilization") == str(round(share, 4))


def test_coprocessor_gpu_stage_streams_from_the_cpu_stages_server():
    from vllm_hybrid.strategies import resolve_split
    plan = plan_from_dict({**PLAN, "strategy": "coprocessor"})
    split, lay, _ = resolve_split(plan, model_shape(LLAMA_8B))
    assert lay.stages == (0,) and lay.layers == (32,) and lay.servers == ((1, 0),)
    ident = identity_from_env({"HYBRID_MASTER_ADDR": "m", "HYBRID_REPLICA": "3"}, stage=0)
    env = {"HYBRID_INSTANCE": "x", "HYBRID_SHM_DIR": "/shm"}
    rec = resolve_stage(plan, split, ident, env, lay)
    argv = vllm_command(plan, rec, ident, python="py")
    # 16 of 32 layers streamed: every other one, two layers ahead
    assert [flag(argv, f) for f in ("--offload-group-size", "--offload-num-in-group", "--offload-prefetch-step")] \
        == ["2", "1", "2"]
    child = vllm_env(plan, rec, ident, None, {})
    assert child["HYBRID_COPROC_SOCKET"] == "/shm/hybrid-x-r3-s1.coproc"
    assert int(child["HYBRID_COPROC_BYTES"]) >= 16 * split.shape.layer_bytes
    assert child["HYBRID_EXPECT_OFFLOADER"] == "PrefetchOffloader"
    # one stage: vLLM's async scheduling, its second batch in flight (the next step scheduled during this one)
    assert "HYBRID_BATCHES_IN_FLIGHT" not in child and "--no-async-scheduling" not in argv


def test_coprocessor_refuses_what_it_cannot_run():
    from vllm_hybrid.strategies import resolve_split
    with pytest.raises(PlanError, match="coprocessor needs the stages of a replica to share /dev/shm"):
        resolve_split(plan_from_dict({**PLAN, "strategy": "coprocessor"}), model_shape(LLAMA_8B), shared_shm=False)
    cpu_only = {**PLAN, "strategy": "coprocessor", "stages": [PLAN["stages"][1], {**PLAN["stages"][1], "name": "c2"}]}
    with pytest.raises(PlanError, match="coprocessor needs a gpu stage"):
        resolve_split(plan_from_dict(cpu_only), model_shape(LLAMA_8B))


def test_cli_coprocessor_cpu_stage_runs_the_product_server(tiny_llama, tmp_path):
    plan = {**PLAN, "model": str(tiny_llama), "dtype": "float32", "max_model_len": 512, "strategy": "coprocessor",
            "stages": [{"name": "gpu", "device": "gpu", "layers": 2}, {"name": "cpu", "device": "cpu", "layers": 2,
                                                                      "cpus": 4, "memory": "4Gi"}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    env = {**os.environ, "HYBRID_CPUS": "0-1", "HYBRID_SHM_DIR": str(tmp_path), "HYBRID_INSTANCE": "t"}
    r = run_cli("serve", "--plan", str(path), "--stage", "1", "--dry-run", env={**env, "HYBRID_CPUS": "0-3"})
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout.split("vllm-hybrid resolved ", 1)[1].splitlines()[0])
    # every core computes: no engine loop to leave one for
    assert resolved["role"] == "coprocessor" and resolved["for_stage"] == 0 and resolved["cpus"] == "0-3"
    assert f"-m vllm_hybrid.strategies.coprocessor.server --socket {tmp_path}/hybrid-t-r0-s1.coproc --metrics-port" in r.stdout


def test_coprocessor_prefetches_one_layer_ahead_unless_two_divide_the_streamed_layers():
    from vllm_hybrid.strategies import resolve_split
    raw = {**PLAN, "strategy": "coprocessor"}
    raw["stages"] = [dict(PLAN["stages"][0], layers=17), dict(PLAN["stages"][1], layers=15)]
    plan = plan_from_dict(raw)
    split, lay, _ = resolve_split(plan, model_shape(LLAMA_8B))
    ident = identity_from_env({"HYBRID_MASTER_ADDR": "m"}, stage=0)
    argv = vllm_command(plan, resolve_stage(plan, split, ident, {}, lay), ident, python="py")
    assert flag(argv, "--offload-prefetch-step") == "1" and flag(argv, "--offload-num-in-group") == "15"


def test_server_threads_one_per_core_spinning_between_calls_unless_the_stage_says_passive():
    from vllm_hybrid.strategies.base import WAIT_ENV, server_env
    binding = plan_binding([2, 3, 4, 5], {0: [2, 3, 4, 5]}, reserve=0)
    image = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "INFINITY", "PATH": "/bin"}
    env = server_env(binding, image, 1, "cpu")
    assert env["OMP_NUM_THREADS"] == "4" and env["GOMP_CPU_AFFINITY"] == binding.omp_bind.replace(",", " ")
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["HYBRID_STAGE"] == "1" and env["PATH"] == "/bin"
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env  # libgomp's own: spin a while, then sleep
    assert server_env(binding, {**image, WAIT_ENV: "passive"}, 1, "cpu")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"  # its experts on transparent huge pages (cpubind.THP_ENV)...
    assert server_env(binding, {"THP_MEM_ALLOC_ENABLE": "0"}, 1, "cpu")["THP_MEM_ALLOC_ENABLE"] == "0"  # ...unless
    with pytest.raises(ValueError, match="HYBRID_SERVER_WAIT='sleep': one of spin, passive"):
        server_env(binding, {WAIT_ENV: "sleep"}, 1, "cpu")


def test_coprocessor_needs_one_cpu_stage_per_gpu_stage():
    from vllm_hybrid.strategies import resolve_split
    three = {**PLAN, "strategy": "coprocessor",
             "stages": [dict(PLAN["stages"][0], layers=8), dict(PLAN["stages"][1], layers=12),
                        dict(PLAN["stages"][1], name="cpu2", layers=12)]}
    with pytest.raises(PlanError, match="coprocessor needs one cpu stage per gpu stage"):
        resolve_split(plan_from_dict(three), model_shape(LLAMA_8B))
    # auto leaves it out of its choices there, and where the gpu stage is tensor-parallel
    _, _, est = resolve_split(plan_from_dict({**three, "strategy": "auto"}), model_shape(LLAMA_8B))
    assert "coprocessor" not in est and "balanced" in est


def test_a_failing_stage_says_why_in_its_termination_message(tmp_path, monkeypatch, capfd):
    """The kubelet's terminationMessagePath gets the stage's own last error line (the operator shows it in
    status); vLLM's output still reaches the stage's log whole."""
    from vllm_hybrid import supervise
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setattr(supervise, "TERMINATION_LOG", str(log))
    crash = ("print('INFO loading weights', flush=True)\n"
             "raise FileNotFoundError('No such file or directory: /models/m/model.safetensors')")
    assert supervise.run_supervised([sys.executable, "-c", crash], dict(os.environ), None) == 1
    assert log.read_text() == ("vLLM exited with code 1: FileNotFoundError: No such file or directory: "
                               "/models/m/model.safetensors\n")
    out = capfd.readouterr().out
    assert "INFO loading weights" in out and "Traceback (most recent call last)" in out
    supervise.termination_message("x", str(tmp_path / "absent"))  # outside a pod: no file is made
    assert not (tmp_path / "absent").exists()


def test_the_error_line_is_the_workers_own_exception_not_the_engines_wrapper():
    import io

    from vllm_hybrid.supervise import OutputTail
    out = io.BytesIO("\n".join([
        "(APIServer pid=7) WARNING This can cause fd limit errors like `OSError: [Errno 24] Too many open files`",
        "(Worker pid=15) Traceback (most recent call last):",
        '(Worker pid=15)   File "/usr/local/lib/python3.11/site-packages/vllm/model_executor/model_loader.py"',
        "(Worker_PP1 pid=20) ERROR 11-25 11:25:05 [multiproc_executor.py:901] FileNotFoundError: No such file "
        "or directory: /models/unreadable/model.safetensors",
        "(Worker pid=15) PermissionError: [Errno 13] Permission denied: '/models/unreadable/model.safetensors'",
        "(EngineCore pid=9) Exception: WorkerProc initialization failed due to an exception in a background "
        "process. See stack trace for root cause.",
        "(APIServer pid=7) RuntimeError: Engine core initialization failed. See root cause above."]).encode())
    tail = OutputTail(out)
    assert tail.error_line().endswith("FileNotFoundError: No such file or directory: "
                                      "/models/unreadable/model.safetensors")




def test_an_unreadable_file_vllm_calls_missing_is_named_as_unreadable(tmp_path):
    """Stages run as uid 1000; a root-only weight file is what vLLM reports as "No such file" (seen on the real
    node). The check is os.access; here a stand-in answers for uid 1000, since the tests run as root."""
    from vllm_hybrid.supervise import unreadable_note
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    line = f"(Worker pid=3) FileNotFoundError: No such file or directory: {weights}"
    assert unreadable_note(line, readable=lambda p: p != str(weights)) == (
        f"{line} ({weights} exists but uid {os.getuid()} cannot read it)")
    assert unreadable_note(line) == line  # readable (root): nothing added
    gone = "FileNotFoundError: No such file or directory: /models/none/model.safetensors"
    assert unreadable_note(gone, readable=lambda p: False) == gone  # really missing: nothing added


def test_model_files_this_uid_cannot_read_are_refused_before_vllm_starts(tmp_path):
    """The launcher names them at once (vLLM would call one missing a minute into each start); files vLLM does not
    read (a README) do not count. A stand-in answers for uid 1000, as above: the tests run as root."""
    from vllm_hybrid.planner import PlanError, check_model_readable, read_model_config
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "tokenizer.json", "README.md"):
        (tmp_path / name).write_text("{}")
    read_model_config(str(tmp_path))  # all readable (root)
    root_only = {"model-00002-of-00002.safetensors", "README.md"}
    with pytest.raises(PlanError) as e:
        check_model_readable(tmp_path, readable=lambda f: os.path.basename(f) not in root_only)
    assert str(e.value).startswith(f"model: uid {os.getuid()} cannot read model-00002-of-00002.safetensors in {tmp_path}")
    assert "README" not in str(e.value) and "chmod a+r" in str(e.value)
    check_model_readable(tmp_path, readable=lambda f: not f.endswith("README.md"))  # not one vLLM reads
