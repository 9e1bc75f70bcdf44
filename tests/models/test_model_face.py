"""What training loops read off the module ``compile`` returns, checked in one process (the loops themselves run in
``tests/models/test_integration_*.py``): the model's signature (a PEFT model's base's), its config and loss
keywords, already prepared for Accelerate; the Trainer options autoshard cannot honour refused by name;
``bf16=True`` becoming the plan's precision; ``batch_axes``."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.errors import InputError
from autoshard.runtime.lazy import LazyShardedModule

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


def _args(**kw: object) -> SimpleNamespace:
    base = dict(
        deepspeed=None,
        fsdp="",
        fp16=False,
        bf16=False,
        load_best_model_at_end=False,
        parallelism_config=None,
        torch_compile=False,
    )
    return SimpleNamespace(**{**base, **kw})


def test_the_module_shows_the_models_signature_config_and_is_prepared_already() -> None:
    model = _llama()
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sharded = autoshard.compile(model, mesh)
        assert isinstance(sharded, LazyShardedModule)
        params = inspect.signature(sharded.forward).parameters
        assert {"input_ids", "attention_mask", "labels"} <= set(params)  # the Trainer keeps these columns
        assert any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())  # takes num_items_in_batch
        assert sharded.config is model.config and sharded.main_input_name == "input_ids"
        assert sharded._is_accelerate_prepared  # Accelerator.prepare returns it as it is: no DDP around it
        assert sharded.batch_axes == (0,)  # DDP's convention until a loop that shards over every process says so
        sharded.split_batch_over_every_rank("a test's loader")
        assert sharded.batch_axes == (0, 1)
        with pytest.raises(InputError, match="batch_axes"):
            autoshard.compile(_llama(), mesh, batch_axes=("pp",))


def test_a_peft_model_shows_its_base_models_signature() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with fake_world(2):
        sharded = autoshard.compile(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
        assert "labels" in inspect.signature(sharded.forward).parameters


def test_trainer_options_autoshard_cannot_honour_are_refused_by_name() -> None:
    from autoshard.integrations.hf_trainer import check_arguments

    with fake_world(2):
        sharded = autoshard.compile(_llama(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
        for name, value in (
            ("deepspeed", "ds.json"),
            ("fsdp", "full_shard"),
            ("fp16", True),
            ("load_best_model_at_end", True),
        ):
            with pytest.raises(InputError, match=f"TrainingArguments\\({name}="):
                check_arguments(_args(**{name: value}), sharded)
        check_arguments(_args(bf16=True), sharded)
        assert sharded.plan_options["mixed_precision"] == "bf16"  # planned so at the first call
        assert sharded.batch_axes == (0,)  # a 1-D mesh: every axis already
