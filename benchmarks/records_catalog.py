"""The Modded-NanoGPT records of the published NPU table, where each one's code lives in KellerJordan/modded-nanogpt,
and how the benchmark shrinks it (benchmarks/records.py).

Record numbers and names are the speedrun README's (records/track_1_short/<folder>/<log>, the log its table links);
the published speedups are the NPU port's table (github.com/zhaoyiyidan/modded-nanogpt-npu README: 8x Ascend 910C,
direct port against optimized minutes; ../shared/reference/nanogpt_npu/trainbridge_published_speedups.csv). Facts
only: the records' code is read from a fetched mirror at run time and never kept here.

The shrink profile is one set of `[overrides]` (sandbox/script/overrides.py: module-level names, class attributes
and dataclass field defaults, keywords forced on a call) shared by the records that use the same names; the
records differ in three naming generations, so there are three profiles, and per-record overrides only where a
record's names differ from its generation's. All run as one process under `torchrun --nproc_per_node=1` (the
records' own launch line is `--nproc_per_node=8`); `nvidia-smi`, which every record logs, is run as /bin/true, and
the records' own torch.compile calls are disabled (below, _COMMON).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATA_DIR = "data/fineweb10B"
MEASURE_PLAN = {"warmup_steps": 1, "steps": 3, "timeout_s": 900}
SHRUNK_VOCAB = 1024  # early records: the model's vocabulary and the shards' token range (5x less step time here)
FULL_VOCAB = 50257  # later records align batches to <|endoftext|> (50256), so their vocabulary stays

# every record: nvidia-smi (which each record logs) run as /bin/true, and the record's own torch.compile calls
# disabled (`torch.compile(..., disable=True)` returns the model or function as it is). The port reports each
# torch.compile as blocking (Inductor has no NPU target; the playbook makes compile the last resort). The records
# were measured eagerly on the emulated NPU, when a compiled model's fused torch_npu rewrites failed in Dynamo
# ("'NpuTensor' object has no attribute '_host'"); a program's own compile runs on the emulation since bbe5347, but
# the results page was not re-run without this override, so it stays until it is. The compile reference is
# Inductor on the host CPU compiling the modules the optimizers train. A bare `@torch.compile` decorator is a call
# too: disabled as well.
_COMMON: dict[str, Any] = {"run(executable)": "/bin/true", "compile(disable)": True}

# records 4-10: `Hyperparameters` dataclass, `GPT(GPTConfig(vocab_size=num_vocab, n_layer=12, n_head=..., n_embd=768))`
EARLY: dict[str, Any] = {
    **_COMMON,
    "Hyperparameters.batch_size": 2,  # sequences across all devices: one accumulation step on one process
    "Hyperparameters.device_batch_size": 2,
    "Hyperparameters.sequence_length": 64,
    "Hyperparameters.num_iterations": 1000,  # more than a measurement takes; the warmdown keeps its own length
    "Hyperparameters.val_loss_every": 0,  # 0: only at the end, which a measurement never reaches
    "Hyperparameters.val_tokens": 128,  # one val batch (B * T)
    "GPTConfig(n_layer)": 2,
    "GPTConfig(n_head)": 2,
    "GPTConfig(n_embd)": 64,
    "num_vocab": SHRUNK_VOCAB,
}

# record 2: llm.c's train_gpt2.py with argparse; the launch line's arguments, and the model table's GPTConfig calls
ARGPARSE: dict[str, Any] = {
    **_COMMON,
    "--batch_size": 2,
    "--sequence_length": 64,
    "--total_batch_size": 128,  # asserted equal to B * T * world size
    "--num_iterations": 1000,
    "--val_loss_every": 0,
    "--save_every": 100_000,  # (step + 1) % save_every: 0 would divide by zero; never reached
    "GPTConfig(n_layer)": 2,
    "GPTConfig(n_head)": 2,
    "GPTConfig(n_embd)": 64,
    "GPTConfig(vocab_size)": SHRUNK_VOCAB,
}

# records 17 on: `GPT(vocab_size=50257, num_layers=..., num_heads=..., model_dim=768, ...)` (17: through
# GPTConfig(...)), token budgets per step instead of sequences, `grad_accum_steps = 8 // world_size`; the layer
# count stays (the records wire skips, value embeddings and dropped layers by layer index), the widths shrink
LATE: dict[str, Any] = {
    **_COMMON,
    "grad_accum_steps": 1,  # 8 // world_size: eight micro-batches on one process otherwise
    "Hyperparameters.num_iterations": 1000,
    "Hyperparameters.val_loss_every": 0,
    "Hyperparameters.save_checkpoint": False,
    "GPT(num_heads)": 2,
    "GPT(head_dim)": 32,
    "GPT(model_dim)": 64,
    "Hyperparameters.train_batch_size": 2048,  # tokens per step, all ranks (the records' 2048 * 24 * 8)
    "Hyperparameters.train_max_seq_len": 1024,
    "Hyperparameters.val_batch_size": 2048,
    "Hyperparameters.val_tokens": 2048,
}


@dataclass(frozen=True)
class RecordSource:
    """One record of the published table and where its code is."""

    number: int
    name: str  # the published table's description
    folder: str  # records/track_1_short/<folder>
    log: str  # the log the speedrun README links (its code first), or the script's path at `commit`
    published_speedup: float | None  # NPU optimized over direct port, the published table (None: not in it)
    script: str = "train_gpt.py"  # the name the record's run.sh launches
    profile: str = "late"  # early | argparse | late
    overrides: dict[str, Any] = field(default_factory=dict)  # where the record's names differ from its profile
    launch_args: str = ""  # arguments of the record's own launch line
    commit: str = ""  # set where the log holds no code: the script is the repository's file at this commit
    note: str = ""  # what the shrink changes beyond sizes, or what the record needs that is not here
    # folders the record writes into without creating them: made in its repository and tracked (a .gitkeep), as a
    # user would `mkdir` them and keep them; an untracked output folder (logs/ is one by its name) is not shown in
    # a run's scratch mirror of the checkout, so only a tracked one reaches the run
    folders: tuple[str, ...] = ()
    # False: `trainbridge run --no-reference` (no torch.compile reference, the run goes on without its kernel counts),
    # where the reference cannot run the record; `reference_why` says why
    reference: bool = True
    reference_why: str = ""

    def overrides_all(self) -> dict[str, Any]:
        base = {"early": EARLY, "argparse": ARGPARSE, "late": LATE}[self.profile]
        merged = {**base, **self.overrides}
        return {key: value for key, value in merged.items() if value is not None}  # None: the profile's key dropped

    def vocab(self) -> int:
        """The token range of the shards written for the record (its model's vocabulary after the shrink): the
        full GPT-2 range, <|endoftext|> included, unless an override shrinks the vocabulary."""
        shrunk = any("vocab" in key and value == SHRUNK_VOCAB for key, value in self.overrides_all().items())
        return SHRUNK_VOCAB if shrunk else FULL_VOCAB

    def launch(self) -> str:
        return f"torchrun --standalone --nproc_per_node=1 {self.script} {self.launch_args}".strip()


_RECORD2_ARGS = ('--input_bin data/fineweb10B/fineweb_train_*.bin --input_val_bin data/fineweb10B/fineweb_val_*.bin '
                 '--output_dir pylog124M --model d12 --batch_size 64 --sequence_length 1024 --total_batch_size 524288 '
                 '--val_loss_every 128 --num_iterations 9536 --weight_decay 0.1 --learning_rate 0.0018 '
                 '--warmup_iters 256 --warmdown_iters 2048')
_LATE_17 = {"GPT(num_heads)": None, "GPT(head_dim)": None, "GPT(model_dim)": None, "grad_accum_steps": None,
            "Hyperparameters.train_batch_size": None, "Hyperparameters.train_max_seq_len": None,
            "Hyperparameters.val_batch_size": None, "Hyperparameters.save_checkpoint": None,
            "GPTConfig(num_heads)": 2, "GPTConfig(model_dim)": 64, "Hyperparameters.batch_size": 1,
            "Hyperparameters.sequence_length": 1024, "Hyperparameters.val_tokens": 1024}
_LATE_27 = {"GPT(head_dim)": None, "Hyperparameters.train_batch_size": None, "Hyperparameters.train_max_seq_len": None,
            "Hyperparameters.val_batch_size": None, "Hyperparameters.train_seq_len": 1024,
            "Hyperparameters.val_seq_len": 1024, "Hyperparameters.val_tokens": 1024,
            "CausalSelfAttention(head_dim)": 32}  # 27 takes head_dim there (default 128), asserting heads * it == width

# 47, 49, 50 schedule the batch size (tokens per step, all ranks) instead of one train_batch_size
_LATE_BS_SCHEDULE = {"Hyperparameters.train_batch_size": None, "Hyperparameters.train_bs_schedule": [2048, 2048, 2048],
                     "Hyperparameters.train_bs_extension": 2048}

RECORDS: tuple[RecordSource, ...] = (
    RecordSource(2, "AdamW rotary lr", "2024-06-06_AdamW", "train_gpt2.py", 1.58, script="train_gpt2.py",
                 profile="argparse", launch_args=_RECORD2_ARGS, overrides={"run(executable)": None},
                 commit="09a49d4af4804af92d14216b43136f5510a8fba8",
                 note="its log (f66d43d7-....log) holds no code: the script is train_gpt2.py of the repository's "
                      "last commit of 2024-06-06 (09a49d4a), launched with that commit's run.sh arguments"),
    RecordSource(4, "Muon improvements", "2024-10-10_Muon", "eb5659d0-fb6a-49e5-a311-f1f89412f726.txt", 1.28,
                 script="train_gpt2.py", profile="early"),
    RecordSource(5, "Modern arch", "2024-10-14_ModernArch", "dabaaddd-237c-4ec9-939d-6608a9ed5e27.txt", 1.87,
                 script="train_gpt2.py", profile="early"),
    RecordSource(6, "Distributed Muon", "2024-10-17_DistributedMuon", "22d24867-eb5a-4fcc-ae2c-263d0277dfd1.txt", 1.87,
                 script="train_gpt2.py", profile="early"),
    RecordSource(7, "PyTorch 2.5", "2024-10-18_PyTorch25", "d4bfb25f-688d-4da5-8743-33926fad4842.txt", 1.83,
                 script="train_gpt2.py", profile="early"),
    RecordSource(8, "Untie embed", "2024-11-03_UntieEmbed", "d6b50d71-f419-4d26-bb39-a60d55ae7a04.txt", 1.79,
                 script="train_gpt2.py", profile="early"),
    RecordSource(9, "Shortcuts & tweaks", "2024-11-06_ShortcutsTweaks", "dd7304a6-cc43-4d5e-adb8-c070111464a1.txt", 1.82,
                 script="train_gpt2.py", profile="early"),
    RecordSource(10, "Cast bf16", "2024-11-08_CastBf16", "a833bed8-2fa8-4cfe-af05-58c1cc48bc30.txt", 2.12,
                 script="train_gpt2.py", profile="early"),
    RecordSource(17, "Sparsify embeds", "2024-12-17_SparsifyEmbeds", "165384d5-5a41-4fba-9b79-8ecc372616ea.txt", 2.58,
                 overrides=_LATE_17, folders=("logs",),
                 note="FlexAttention (block masks); it opens logs/<run>.txt without creating logs/ (its mkdir is "
                      "commented out): its repository keeps an empty logs/ (logs/.gitkeep), as a user would mkdir it"),
    RecordSource(27, "Triton Muon", "2025-07-18_TritonMuon", "record.txt", 2.06, overrides=_LATE_27,
                 note="FlexAttention and a Triton symmetric-matmul kernel"),
    RecordSource(32, "Vect sigmoid bf16", "2025-09-11_VectSigmoidBFloat16", "0d0d9882-c34f-4d82-b961-a17d5659c988.txt",
                 1.94, note="flash_attn_interface (FlashAttention-3) and Triton kernels"),
    RecordSource(37, "BF16 CE", "2025-09-27_BF16CE", "08c0770f-17fc-44cd-971d-734a7a28a3e3.txt", 1.79,
                 note="flash_attn_interface (FlashAttention-3) and Triton kernels"),
    RecordSource(38, "Polar Express", "2025-09-29_PolarExpress", "0e3f0af5-ad08-47a6-813d-0c709b50d422.txt", 2.07),
    RecordSource(39, "Custom batching", "2025-09-30_CustomBatching", "40b101b1-77ea-45ea-a089-1d3a647daa22.txt", 1.95,
                 folders=("logs/new",), note="its run_id defaults to new/<uuid>: it opens logs/new/<run>.txt, making only logs/"),
    RecordSource(40, "Backout", "2025-10-04_Backout", "514e7581-fbd4-4338-a3e4-e556f9c958ce.txt", 2.06,
                 folders=("logs/new",), note="its run_id defaults to new/<uuid>: it opens logs/new/<run>.txt, making only logs/"),
    RecordSource(41, "NorMuon", "2025-10-24_NorMuon", "088a77ee-9b67-475a-bbb9-3e92e4698799.txt", 1.86),
    RecordSource(42, "Fix Muon LR", "2025-10-27_FixMuonLR", "14afd380-d3d9-48d7-ad23-4c13cb96754b.txt", 2.01),
    RecordSource(47, "SA lambda on weights", "2025-12-10_SALambdaOnWeights", "15ef5eaf-56e1-40e1-9ddf-af010027c9dd.txt",
                 1.95, overrides=_LATE_BS_SCHEDULE),
    RecordSource(49, "Partial key offset", "2025-12-14_PartialKeyOffset", "150d40bf-c20b-4568-aac9-26eb919e25fd.txt",
                 2.05, overrides=_LATE_BS_SCHEDULE),
    RecordSource(50, "Cautious WD Adam", "2025-12-18_CautiousWDAdam", "1981d492-bc65-4ba9-a0fa-2b30fc5c3eba.txt", 2.19,
                 overrides=_LATE_BS_SCHEDULE),
)

# records of the speedrun that the published NPU table leaves out, run as a user would (issue 25: a FlexAttention-era
# record the team had not used, from its log to `port` to `run --target npu` with the compile reference): their
# trainbridge.toml holds only the launch line, the data and the size overrides (no compile(disable), no nvidia-smi
# stand-in: the port carries both, and the script's own torch.compile runs on the emulated device)
_USER_AS_IS = {"compile(disable)": None, "run(executable)": None}
# record 12 keeps its 50304-token vocabulary, so the shards hold <|endoftext|> (every 97th token) and its document
# mask, (idx == 50256).cumsum(0), sees 2-3 documents in each 128-token batch
UNPUBLISHED: tuple[RecordSource, ...] = (
    RecordSource(12, "FlexAttention", "2024-11-19_FlexAttention", "8384493d-dba9-4991-b16b-8696953f5e6d.txt", None,
                 profile="early", overrides={**_USER_AS_IS, "num_vocab": None},
                 note="FlexAttention with a document-causal, 1024-token-window block mask (create_block_mask), ported "
                      "to npu_fusion_attention (TND, one sequence per document); its one 64K-token sequence shrunk to "
                      "128 tokens (device_batch_size 2 x sequence_length 64, read as one sequence): 2-3 documents a "
                      "batch"),
)
BY_NUMBER = {r.number: r for r in RECORDS + UNPUBLISHED}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def toml_text(source: RecordSource) -> str:
    """The record's trainbridge.toml: its launch line on one process, the git-ignored shards, the shrink."""
    lines = [f"# record {source.number} ({source.name}), shrunk by benchmarks/records.py",
             f"launch = {_toml_value(source.launch())}", f'data = ["{DATA_DIR}/"]']
    lines += [f"{key} = {_toml_value(value)}" for key, value in MEASURE_PLAN.items()]
    lines += ["", "[overrides]"]
    lines += [f"{_toml_value(key)} = {_toml_value(value)}" for key, value in source.overrides_all().items()]
    return "\n".join(lines) + "\n"
