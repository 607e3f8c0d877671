"""Roofline step times: prefill compute-bound, decode bandwidth-bound, from datasheet
figures. Expected values are recomputed here from the spec and catalogue figures."""
from __future__ import annotations

import pytest

from appliance.engines.roofline import (
    BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY, NVLINK_BW, PCIE_BW, STEP_OVERHEAD_S,
    DeviceShape, StepTimeModel,
)
from appliance.models.specs import lookup_model_spec
from appliance.partitions.catalogue import A100_80GB, H100_SXM, H200, L40S

L8 = lookup_model_spec("llama-3.1-8b")
L70 = lookup_model_spec("llama-3.1-70b")
L70_FP8 = lookup_model_spec("llama-3.1-70b-fp8")
GPT_OSS = lookup_model_spec("gpt-oss-120b")


def model(spec, gpu=H100_SXM, tp: int = 1) -> StepTimeModel:
    return StepTimeModel(DeviceShape.from_gpu(gpu, spec.weight_bytes), tp, spec)


def terms_prefill(spec, gpu, tokens: int) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one uncached prompt on one device."""
    attn = 4.0 * spec.layers * spec.heads * spec.head_dim * tokens * (tokens / 2)
    flops = 2.0 * spec.params * tokens + attn
    bytes_ = spec.params * spec.weight_bytes + spec.kv_bytes_per_token() * tokens
    return (flops / (gpu.flops_bf16 * COMPUTE_EFFICIENCY),
            bytes_ / (gpu.mem_bw * BANDWIDTH_EFFICIENCY))


def test_device_shape_from_catalogue():
    shape = DeviceShape.from_gpu(H100_SXM, L8.weight_bytes)
    assert shape.flops == H100_SXM.flops_bf16
    assert shape.mem_bw == H100_SXM.mem_bw and shape.mem_bytes == H100_SXM.mem_bytes
    assert shape.link_bw == NVLINK_BW
    assert DeviceShape.from_gpu(L40S, L8.weight_bytes).link_bw == PCIE_BW


def test_prefill_4096_is_compute_bound_on_h100():
    compute, memory = terms_prefill(L8, H100_SXM, 4096)
    assert compute > 5 * memory
    t = model(L8).prefill_s([4096], [0])
    assert t == pytest.approx(compute + STEP_OVERHEAD_S, rel=1e-9)
    assert 0.05 < t < 0.5                             # ~0.13 s: sane for 8B on one H100


def test_prefill_time_scales_with_tokens_for_large_prompts():
    m = model(L8)
    t4k, t8k = m.prefill_s([4096], [0]), m.prefill_s([8192], [0])
    # Linear in tokens, plus a growing quadratic attention share.
    assert 2.0 < t8k / t4k < 2.3
    # The same tokens split over two prompts cost less attention than one long prompt.
    assert m.prefill_s([4096, 4096], [0, 0]) < t8k


def test_cached_context_costs_attention_in_prefill():
    m = model(L8)
    assert m.prefill_s([512], [8192]) > m.prefill_s([512], [0])
    # ...but far less than recomputing the cached part.
    assert m.prefill_s([512], [8192]) < m.prefill_s([8704], [0]) / 4


def test_decode_batch_one_is_weight_bandwidth():
    m = model(L8)
    bw = H100_SXM.mem_bw * BANDWIDTH_EFFICIENCY
    ctx = 128
    expected = (L8.weight_total_bytes() + L8.kv_bytes_per_token() * ctx) / bw + STEP_OVERHEAD_S
    assert m.decode_s([ctx]) == pytest.approx(expected, rel=1e-9)
    # Weights alone dominate: the roofline's memory side, not its compute side.
    flops_s = 2.0 * L8.params / (H100_SXM.flops_bf16 * COMPUTE_EFFICIENCY)
    assert flops_s < 0.1 * (L8.weight_total_bytes() / bw)
    assert m.decode_s([ctx]) == pytest.approx(L8.weight_total_bytes() / bw + STEP_OVERHEAD_S,
                                              rel=0.01)


def test_decode_is_weakly_batch_dependent_at_small_batch():
    m = model(L8)
    one, eight = m.decode_s([128]), m.decode_s([128] * 8)
    assert one < eight < 1.2 * one


def test_decode_grows_with_total_context():
    m = model(L8)
    bw = H100_SXM.mem_bw * BANDWIDTH_EFFICIENCY
    short, mid, long = (m.decode_s([c] * 8) for c in (1000, 8000, 32000))
    assert short < mid < long
    # The growth is KV traffic: bytes per token times the added context, over bandwidth.
    assert long - short == pytest.approx(L8.kv_bytes_per_token() * 8 * 31000 / bw, rel=1e-9)
    # Same total context, different split: same time (bandwidth sees only bytes).
    assert m.decode_s([16000, 16000]) == pytest.approx(m.decode_s([1000, 31000]), rel=1e-12)


def test_tensor_parallel_lowers_step_time_but_not_below_half():
    one, two = model(L8, tp=1), model(L8, tp=2)
    for f in (lambda m: m.decode_s([512] * 4), lambda m: m.prefill_s([4096], [0])):
        assert f(two) < f(one)
        assert f(two) > f(one) / 2                     # all-reduce and overhead don't split


def test_h200_decodes_faster_and_prefills_the_same():
    h100, h200 = model(L8, H100_SXM), model(L8, H200)
    assert h200.decode_s([2048] * 8) < h100.decode_s([2048] * 8)
    ratio = (h200.decode_s([2048] * 8) - STEP_OVERHEAD_S) / (
        h100.decode_s([2048] * 8) - STEP_OVERHEAD_S)
    assert ratio == pytest.approx(H100_SXM.mem_bw / H200.mem_bw, rel=1e-9)
    # Same Hopper compute: a compute-bound prefill takes the same time.
    assert h200.prefill_s([4096], [0]) == pytest.approx(h100.prefill_s([4096], [0]), rel=1e-9)


def test_fp8_weights_use_fp8_flops():
    assert DeviceShape.from_gpu(H100_SXM, L70_FP8.weight_bytes).flops == H100_SXM.flops_fp8
    assert DeviceShape.from_gpu(H100_SXM, L70.weight_bytes).flops == H100_SXM.flops_bf16
    # No FP8 tensor cores on A100: FP8 weights still run at bf16 rate.
    assert DeviceShape.from_gpu(A100_80GB, L70_FP8.weight_bytes).flops == A100_80GB.flops_bf16
    fp8, bf16 = model(L70_FP8, tp=4), model(L70, tp=4)
    ratio = fp8.prefill_s([8192], [0]) / bf16.prefill_s([8192], [0])
    assert 0.45 < ratio < 0.6                          # ~half: twice the FLOP/s
    assert fp8.decode_s([1024]) < bf16.decode_s([1024])  # half the weight bytes


def test_moe_decode_reads_only_active_experts():
    m = model(GPT_OSS)
    bw = H100_SXM.mem_bw * BANDWIDTH_EFFICIENCY
    active_bytes = GPT_OSS.active_params * GPT_OSS.weight_bytes
    assert m.decode_s([100]) == pytest.approx(
        (active_bytes + GPT_OSS.kv_bytes_per_token() * 100) / bw + STEP_OVERHEAD_S, rel=1e-9)
    assert m.decode_s([100]) < model(L8).decode_s([100])
    # A big batch touches every expert, but never more than all of them.
    big = m.decode_s([100] * 512)
    all_weights = (GPT_OSS.weight_total_bytes() + GPT_OSS.kv_bytes_per_token() * 51200) / bw
    flops = (2.0 * GPT_OSS.active_params * 512
             + 4.0 * GPT_OSS.layers * GPT_OSS.heads * GPT_OSS.head_dim * 51200)
    assert big == pytest.approx(
        max(all_weights, flops / (H100_SXM.flops_fp8 * COMPUTE_EFFICIENCY)) + STEP_OVERHEAD_S,
        rel=1e-9)


def test_kv_capacity():
    cap8 = model(L8).kv_capacity_tokens()
    expected = int((H100_SXM.mem_bytes * 0.9 - L8.weight_total_bytes()) // L8.kv_bytes_per_token())
    assert cap8 == expected
    assert 300_000 < cap8 < 600_000
    assert model(L8).kv_capacity_tokens(0.5) < cap8
    assert model(L70).kv_capacity_tokens() == 0        # 141 GB of weights on 80 GiB
    assert model(L70, tp=2).kv_capacity_tokens() > 0
    assert model(L70_FP8).kv_capacity_tokens() > 0     # 70 GB of fp8 weights just fit


def test_transfer_time_is_kv_bytes_over_link():
    m = model(L8)
    t1, t2 = m.transfer_s(1000), m.transfer_s(2000)
    assert t2 - t1 == pytest.approx(1000 * L8.kv_bytes_per_token() / NVLINK_BW, rel=1e-9)
    pcie = StepTimeModel(DeviceShape.from_gpu(L40S, L8.weight_bytes), 1, L8)
    assert pcie.transfer_s(2000) > t2
