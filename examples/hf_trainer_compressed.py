"""A Hugging Face transformers model with compressed activations, trained by ``transformers.Trainer``
with a lowbit optimizer.

    python examples/hf_trainer_compressed.py [--steps 40]

The model is a small Llama built from a local ``LlamaConfig`` (nothing is downloaded), reading bytes of
the CPython standard library sources as tokens (vocabulary 256). :func:`lowbit.nn.compress_activations`
swaps its SiLU activations for inverted ones (inverted-activations.txt: the output plus one bit is saved
for backward instead of the input), which keeps every forward output bit for bit; the bytes saved for
backward by one batch are measured before and after with :func:`lowbit.memory.saved_tensor_bytes`.
``Trainer`` gets :class:`lowbit.optim.AdamW8bit` through its ``optimizers`` argument and builds its
usual learning-rate schedule around it.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import lowbit.nn
import lowbit.optim
from lowbit.demo import load_text
from lowbit.memory import saved_tensor_bytes

CONTEXT = 64


class ByteWindows(torch.utils.data.Dataset):
    """Windows of CONTEXT bytes at fixed random offsets; the labels are the inputs (the model shifts them)."""

    def __init__(self, data: torch.Tensor, count: int) -> None:
        self.data = data
        self.starts = torch.randint(0, len(data) - CONTEXT, (count,), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[self.starts[i] : self.starts[i] + CONTEXT].long()
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
    )
    model = LlamaForCausalLM(config)
    data = ByteWindows(load_text(max_bytes=400_000), 16 * args.steps)
    batch = torch.stack([data[i]["input_ids"] for i in range(16)])
    before = saved_tensor_bytes(model, input_ids=batch, labels=batch).total
    with torch.no_grad():
        reference = model(input_ids=batch).logits
    report = lowbit.nn.compress_activations(model, method="invact")
    print(report)
    with torch.no_grad():
        same = torch.equal(model(input_ids=batch).logits, reference)
    after = saved_tensor_bytes(model, input_ids=batch, labels=batch).total
    print(
        f"saved for backward per batch: {before:,} -> {after:,} bytes ({after / before:.3f}x); logits unchanged: {same}"
    )

    opt = lowbit.optim.AdamW8bit(model.parameters(), lr=2e-3, weight_decay=0.01)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=16,
            logging_steps=max(1, args.steps // 4),
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=data, optimizers=(opt, None))
        result = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    print(f"Trainer with {type(inner).__name__}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
    print(f"train loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
