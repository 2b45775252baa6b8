"""Train a tiny Hugging Face Llama with transformers' Trainer: the model's code and the training loop both live in libraries.

Random weights from a config and random token ids: nothing is downloaded. The Trainer builds the optimizer (accelerate's
AcceleratedOptimizer around AdamW), seeds with its own `set_seed`, and runs the loop; this file only configures it.
Eager attention, as many scripts written for accelerators without a fused SDPA ask for it. On the CPU (`use_cpu`).
"""
import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed


class RandomTokens(Dataset):
    def __init__(self, count, length, vocab):
        self.ids = torch.randint(0, vocab, (count, length))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and state.global_step % 10 == 0:
            print(f"step {state.global_step} loss {logs['loss']:.4f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seq_len", type=int, default=512)
    args = parser.parse_args()
    set_seed(1234)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=args.seq_len, use_cache=False,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config)
    training = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf-llama-trainer-"), max_steps=args.max_steps,
                                 per_device_train_batch_size=args.batch_size, learning_rate=1e-3, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    data = RandomTokens(64 * args.batch_size, args.seq_len, config.vocab_size)
    Trainer(model=model, args=training, train_dataset=data, callbacks=[PrintLoss()]).train()


if __name__ == "__main__":
    main()
