"""Train with the Hugging Face Trainer (or TRL's SFTTrainer) on a model autoshard compiled: one line changed.

    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py                      # the solved plan
    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py --reference          # the Trainer's own DDP
    torchrun --standalone --nproc-per-node 4 examples/trainer_hf.py --mesh 2x2 --recipe fsdp+tp
    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py --sft                # TRL's SFTTrainer, chats
    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py --out /tmp/tr --save-steps 10
    torchrun --standalone --nproc-per-node 1 examples/trainer_hf.py --out /tmp/tr --resume   # onto 1 rank

The script is what a Trainer user already has: a stock ``LlamaForCausalLM`` (a small config built here, the same
seed on every rank), a list of ``{"input_ids", "labels"}`` rows (each row's prompt masked with -100, so the rows
count different numbers of targets and the Trainer passes ``num_items_in_batch``), ``TrainingArguments`` with
the Trainer's defaults where the run allows (``max_grad_norm=1.0``, AdamW, linear decay) and ``use_cpu`` on a
machine without CUDA. The one autoshard line is

    model = autoshard.compile(model, mesh)

(left out by ``--reference``, which trains the same job under the Trainer's own DistributedDataParallel). The
Trainer's data loader gives every process its own rows; autoshard takes them as the global batch over every
mesh axis (``autoshard/integrations/``). ``--lora`` wraps the model in PEFT LoRA adapters first (the base frozen;
``save_model`` then writes the adapters as PEFT does). ``--sft`` trains TRL's ``SFTTrainer`` on a chat dataset built
here (``messages`` rendered by a chat template of a word-level tokenizer built here, nothing downloaded).

Rank 0 prints one line ``history {json}`` at the end: the Trainer's log history (loss and grad_norm per step,
eval losses), which the tests compare between the two runs. ``--out`` with ``--save-steps`` writes the Trainer's
``checkpoint-N`` folders (a ``from_pretrained`` folder, the model's and optimizer's shards in
``autoshard-state/``, the scheduler and RNG states); ``--resume`` continues from the latest (``--resume DIR``: from
that one), on any number of ranks; ``--save-model`` writes the final model with ``trainer.save_model()``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import autoshard

VOCAB = 128
WORDS = (
    "the",
    "a",
    "model",
    "trains",
    "on",
    "every",
    "rank",
    "with",
    "its",
    "own",
    "rows",
    "and",
    "plan",
    "shards",
    "weights",
    "over",
    "mesh",
    "axes",
    "loss",
    "falls",
    "fast",
    "slow",
    "step",
    "by",
    "one",
    "two",
    "three",
)


def build_model(seed: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def token_rows(n: int, seq: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of ``seq`` tokens; each row's first 1..seq/2 tokens are its prompt (label -100)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, seq // 2, (1,), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def chat_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ``WORDS`` with a chat template (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<unk>", "<eos>", "<user>", "<assistant>"]
    vocab = {w: i for i, w in enumerate([*specials, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} "
        "{% if m['role'] == 'assistant' %}<eos> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    return tok


def chats(n: int, seed: int) -> list[dict[str, list[dict[str, str]]]]:
    """``n`` two-turn conversations of words from ``WORDS``, of varied lengths."""
    g = torch.Generator().manual_seed(seed)

    def sentence() -> str:
        k = int(torch.randint(3, 9, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))

    return [
        {"messages": [{"role": "user", "content": sentence()}, {"role": "assistant", "content": sentence()}]}
        for _ in range(n)
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", action="store_true", help="the Trainer's own DDP, without autoshard")
    ap.add_argument("--recipe", help="a recipe instead of the solved plan (fsdp, fsdp+tp, ddp, ...)")
    ap.add_argument("--mesh", help="mesh shape over the world, e.g. 2 or 2x2 (axes dp, tp); default (world,)")
    ap.add_argument("--sft", action="store_true", help="TRL's SFTTrainer on a chat dataset")
    ap.add_argument("--lora", action="store_true", help="PEFT LoRA adapters on q/v projections, the base frozen")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="global batch: rows per step over all processes")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps on held-out rows (0: never)")
    ap.add_argument("--out", default="trainer_hf_out")
    ap.add_argument("--save-steps", type=int, default=0, help="write a checkpoint-N folder every N steps")
    ap.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT",
        help="continue from the latest checkpoint in --out, or from the checkpoint-N folder given",
    )
    ap.add_argument("--save-model", action="store_true", help="trainer.save_model(--out/final) at the end")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    if args.batch % (world * args.grad_accum):
        raise SystemExit(f"--batch {args.batch} must be a multiple of world x grad-accum = {world * args.grad_accum}")

    tokenizer = chat_tokenizer() if args.sft else None
    model = build_model(args.seed, len(tokenizer) if tokenizer is not None else VOCAB)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        )
    if not args.reference:
        shape = tuple(int(x) for x in args.mesh.split("x")) if args.mesh else (world,)
        mesh = init_device_mesh(
            "cuda" if torch.cuda.is_available() else "cpu", shape, mesh_dim_names=("dp", "tp")[: len(shape)]
        )
        model = autoshard.compile(model, mesh, **({"recipe": args.recipe} if args.recipe else {}))  # the one line

    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch // (world * args.grad_accum),
        per_device_eval_batch_size=args.batch // world,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        bf16=args.bf16,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    if args.sft:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        sft = SFTConfig(
            **{
                k: v
                for k, v in training.to_dict().items()
                if k in SFTConfig.__dataclass_fields__ and not k.startswith("_") and k not in ("push_to_hub_token",)
            },
            max_length=args.seq * 2,
            dataset_num_proc=None,
        )
        trainer: Trainer = SFTTrainer(
            model=model,
            args=sft,
            processing_class=tokenizer,
            train_dataset=Dataset.from_list(chats(256, args.seed + 1)),
            eval_dataset=Dataset.from_list(chats(32, args.seed + 2)) if args.eval_steps else None,
        )
    else:
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=token_rows(256, args.seq, args.seed + 1),
            eval_dataset=token_rows(32, args.seq, args.seed + 2) if args.eval_steps else None,
        )
    trainer.train(resume_from_checkpoint=args.resume)
    if args.save_model:
        trainer.save_model(os.path.join(args.out, "final"))
    if dist.get_rank() == 0:
        keep = ("step", "loss", "grad_norm", "eval_loss", "learning_rate")
        history = [{k: v for k, v in h.items() if k in keep} for h in trainer.state.log_history]
        print("history " + json.dumps(history), flush=True)
    # the Trainer's own DDP (--reference) holds the process group too: freed at interpreter exit, after
    # destroy_process_group, its reducer would free the gloo group while holding the GIL that the group's worker
    # thread needs to free a finished gather (torch 2.13: a deadlock at exit). Freed here, the group outlives it
    del trainer, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
