"""Builds the engine a WorkerSpec names. Heavy imports (torch, tensorrt_llm) happen
here, inside the worker, never in the daemon."""
from __future__ import annotations

from pathlib import Path

from appliance.models.eos import read_eos_ids
from appliance.worker.spec import WorkerSpec


def regular_token_ids(model_dir: Path) -> list[int]:
    """Ids of the served tokenizer that decode to whole characters on their own (so
    simulated text is valid UTF-8), special tokens excluded."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    special_ids = {tok.token_to_id(s) for s in special}
    return [i for i in range(tok.get_vocab_size())
            if i not in special_ids and "\ufffd" not in tok.decode([i])]


def build_engine(spec: WorkerSpec):
    model_dir = Path(spec.model_dir)
    if spec.engine == "sim":
        return _build_sim(spec, model_dir)
    if spec.engine == "torch":
        from appliance.engines.torch_engine import build_torch_engine
        return build_torch_engine(spec, model_dir)
    if spec.engine == "trtllm":
        from appliance.engines.trtllm import build_trtllm_engine
        return build_trtllm_engine(spec, model_dir)
    raise ValueError(f"unknown engine {spec.engine!r}")


def _build_sim(spec: WorkerSpec, model_dir: Path):
    from appliance.engines.roofline import CPU_SHAPE, DeviceShape, StepTimeModel
    from appliance.engines.sim import SimEngine
    from appliance.models.specs import lookup_model_spec, spec_from_hf_config
    from appliance.partitions.catalogue import lookup_gpu

    model = (lookup_model_spec(spec.model_spec) if spec.model_spec
             else spec_from_hf_config(model_dir / "config.json"))
    if spec.device_kind == "cpu":
        shape, tp = CPU_SHAPE, 1
    else:
        shape, tp = DeviceShape.from_gpu(lookup_gpu(spec.gpu_name), model.weight_bytes), len(spec.devices)
    timing = StepTimeModel(shape, tp, model)
    if spec.device_kind == "cpu":
        tokens = int(spec.kv_cache_bytes // model.kv_bytes_per_token())
    else:
        tokens = timing.kv_capacity_tokens(spec.gpu_mem_fraction)
    num_blocks = tokens // spec.block_size
    if num_blocks < 1:
        raise ValueError(f"model {model.name} ({model.weight_total_bytes() / 1e9:.0f} GB of "
                         f"weights) leaves no room for KV on {tp}x{shape.name}")
    from appliance.engines.grammar import GrammarBook
    vocab_ids = regular_token_ids(model_dir)
    return SimEngine(
        timing=timing, vocab_ids=vocab_ids, speed=spec.sim_speed,
        grammar=GrammarBook(model_dir, 0, read_eos_ids(model_dir)),
        worker=spec.worker, devices=tuple(spec.devices), num_blocks=num_blocks,
        block_size=spec.block_size, max_batch_tokens=spec.max_batch_tokens,
        max_seqs=spec.max_seqs, max_context=model.max_context,
        eos_token_ids=read_eos_ids(model_dir), handoff_timeout_s=spec.handoff_timeout_s,
        reserve_ratio=spec.reserve_ratio, prefill_chunk_tokens=spec.prefill_chunk_tokens,
        fair_queuing=spec.fair_queuing, fair_chunk_tokens=spec.fair_chunk_tokens)
