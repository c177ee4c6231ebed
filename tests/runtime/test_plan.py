import pytest
from vllm_hybrid.plan import PlanError, load_plan, parse_quantity, plan_from_dict, plan_to_dict


def base(**over):
    plan = {"model": "/m", "stages": [
        {"name": "gpu", "device": "gpu", "memory": "80Gi"},
        {"name": "cpu", "device": "cpu", "cpus": 8, "memory": "32Gi"}]}
    plan.update(over)
    return plan


def test_defaults_and_round_trip():
    plan = plan_from_dict(base())
    assert plan.block_size == 128 and plan.supervision_port == plan.master_port + 1
    assert plan.stages[1].memory_bytes == 32 * 2**30 and plan.stages[0].gpu_memory_utilization == 0.9
    assert plan_from_dict(plan_to_dict(plan)) == plan


@pytest.mark.parametrize("text,value", [("64Gi", 64 * 2**30), ("500M", 500 * 10**6), ("1.5Gi", 3 * 2**29),
                                        (1024, 1024), ("2048", 2048),
                                        ("1.1Gi", 1181116007)])  # rounded up, as the operator rounds pods
def test_quantities(text, value):
    assert parse_quantity(text, "x") == value


@pytest.mark.parametrize("mutate,field", [
    (lambda p: p.pop("model"), "model"),
    (lambda p: p.update(stages=[]), "stages"),
    (lambda p: p.update(dtype="int4"), "dtype"),
    (lambda p: p.update(block_size=100), "block_size"),
    (lambda p: p.update(max_model_len=0), "max_model_len"),
    (lambda p: p.update(max_model_len="big"), "max_model_len"),
    (lambda p: p.update(api_port=70000), "api_port"),
    (lambda p: p.update(api_port=29500), "api_port/master_port"),
    (lambda p: p.update(extra_args="--x"), "extra_args"),
    (lambda p: p.update(bogus=1), "bogus"),
    (lambda p: p["stages"][0].update(device="tpu"), "stages[0].device"),
    (lambda p: p["stages"][0].update(name="GPU_0"), "stages[0].name"),
    (lambda p: p["stages"][1].update(name="gpu"), "stages[1].name"),
    (lambda p: p["stages"][1].pop("cpus"), "stages[1].cpus"),
    (lambda p: p["stages"][1].pop("memory"), "stages[1].memory"),
    (lambda p: p["stages"][1].update(cpus=2.5), "stages[1].cpus"),
    (lambda p: p["stages"][1].update(memory="lots"), "stages[1].memory"),
    (lambda p: p["stages"][1].update(gpu_memory_utilization=0.5), "stages[1].gpu_memory_utilization"),
    (lambda p: p["stages"][0].update(cpus=4), "stages[0].cpus"),
    (lambda p: p["stages"][0].update(gpu_memory_utilization=1.5), "stages[0].gpu_memory_utilization"),
    (lambda p: p["stages"][0].update(tensor_parallel=2), "stages[*].tensor_parallel"),
    (lambda p: p["stages"][0].update(layers=4), "stages[1].layers"),
    (lambda p: p["stages"][0].update(layers=0), "stages[0].layers"),
    (lambda p: p["stages"][0].update(foo=1), "stages[0].foo"),
    (lambda p: p.update(max_num_seqs=512, max_num_batched_tokens=256), "max_num_batched_tokens"),
])
def test_bad_plans_name_the_field(mutate, field):
    plan = base()
    mutate(plan)
    with pytest.raises(PlanError) as e:
        plan_from_dict(plan)
    assert str(e.value).startswith(field), str(e.value)


def test_load_plan_file_errors(tmp_path):
    with pytest.raises(PlanError, match="plan file .*No such file"):
        load_plan(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(PlanError, match="top level"):
        load_plan(lst)
