"""TRL's preference trainers under dzctl's Trainer (``train.stage: dpo | kto``; docs/preference.md).

Which TRL class trains what (TRL 1.16):

- ``dpo`` with ``pref_loss: sigmoid | ipo``: ``DPOTrainer`` (``loss_type`` sigmoid or ipo; ``pref_ftx`` adds
  its ``sft`` loss with that weight, as LLaMA-Factory's ``pref_ftx`` does);
- ``dpo`` with ``pref_loss: simpo``: ``trl.experimental.cpo.CPOTrainer`` with ``loss_type="simpo"``
  (TRL 1.16's DPOTrainer has no SimPO loss; ``pref_ftx`` is its ``cpo_alpha``, the NLL term);
- ``dpo`` with ``pref_loss: orpo``: ``trl.experimental.orpo.ORPOTrainer`` (``pref_beta`` is its lambda);
- ``kto``: ``KTOTrainer`` (``kto_chosen_weight`` / ``kto_rejected_weight`` its desirable/undesirable weights).

Each is mixed under ``run.DzTrainer`` (passed in; first in the MRO), so checkpoints, markers,
rotation, LoRA's adapter saves, token counting and the stall pulse are SFT's. The rows arrive
tokenized (``encode.py``: the chat template renders them as SFT's); each trainer's own
tokenization is bypassed where it would tokenize again.

The reference policy (sigmoid, ipo, kto): LoRA uses the base with the adapters switched off (TRL
then computes it through the same partitioned weights, no copy); full fine-tuning gets a frozen
ZeRO-3 copy (TRL wraps it in a DeepSpeed inference engine) or the log-probs computed once before
training (``precompute_ref_log_probs``), as ``planning/preference/reference.py`` chose.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset

from ...planning.preference.reference import Reference
from ...spec.job import TrainSpec


def config_class_and_fields(train: TrainSpec, reference: Reference) -> tuple[type, dict[str, Any]]:
    """The TRL config class of this stage and the fields dzctl sets beside ``TrainingArguments``'."""
    common = {"max_length": train.max_seq_len, "beta": train.pref_beta, "dataset_num_proc": None}
    if train.stage == "kto":
        from trl import KTOConfig

        return KTOConfig, {
            **common,
            "desirable_weight": train.kto_chosen_weight,
            "undesirable_weight": train.kto_rejected_weight,
            "precompute_ref_log_probs": reference == "precomputed",
        }
    if train.pref_loss == "simpo":
        from trl.experimental.cpo import CPOConfig

        return CPOConfig, {
            **common,
            "loss_type": "simpo",
            "simpo_gamma": train.simpo_gamma,
            "cpo_alpha": train.pref_ftx,
        }
    if train.pref_loss == "orpo":
        from trl.experimental.orpo import ORPOConfig

        return ORPOConfig, common
    from trl import DPOConfig

    losses = [train.pref_loss] + (["sft"] if train.pref_ftx else [])
    weights = [1.0, train.pref_ftx] if train.pref_ftx else None
    return DPOConfig, {
        **common,
        "loss_type": losses,
        "loss_weights": weights,
        "precompute_ref_log_probs": reference == "precomputed",
    }


def _dpo_class(dz_trainer, base):
    class DzDPOTrainer(dz_trainer, base):
        """DPO/KTO on rows tokenized by dzctl: TRL's own tokenization is left out."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" not in dataset.column_names:
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            if getattr(self, "calculate_KL", False):
                # KTO's KL term: the completions rotated by one within each micro-batch (TRL's own rule).
                def add_kl(examples):
                    examples["KL_completion_ids"] = [examples["completion_ids"][-1], *examples["completion_ids"][:-1]]
                    return examples

                dataset = dataset.map(add_kl, batched=True, batch_size=args.per_device_train_batch_size)
            return dataset

        def _precompute_ref_logps(self, dataset, name, batch_size):
            """TRL's pass (its loader, engine and gather), the values kept in memory on every rank.

            TRL writes them from rank 0 into a cache file beside the dataset for the others to read; the
            rows here are in memory (no shared folder: each rank's own temporary one), so every rank keeps
            the gathered values itself.
            """
            import torch
            from torch.utils.data import DataLoader
            from trl.models import prepare_deepspeed

            loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False)
            loader = self.accelerator.prepare(loader)
            if self.ref_model is None and self.is_deepspeed_enabled:
                if self._precompute_engine is None:
                    self._precompute_engine = prepare_deepspeed(self.model, self.accelerator)
                model = self._precompute_engine
            else:
                model = self.ref_model or self.model
            kto = "completion_ids" in dataset.column_names
            names = ("ref_logps", "ref_KL_logps") if kto else ("ref_chosen_logps", "ref_rejected_logps")
            values: tuple[list, list] = ([], [])
            for batch in loader:
                first, second = self.compute_ref_log_probs(model, batch)
                pair = (first, second) if second is not None else (first,)
                for store, value in zip(values, self.accelerator.gather_for_metrics(pair), strict=False):
                    store.append(value.cpu())
            for column, store in zip(names, values, strict=True):
                if store:
                    dataset = dataset.add_column(column, torch.cat(store).tolist())
            return dataset

    return DzDPOTrainer


def _paired_class(dz_trainer, base):
    """CPO (SimPO) and ORPO tokenize each row in ``tokenize_row``: here from dzctl's ids."""

    class DzPairedTrainer(dz_trainer, base):
        def tokenize_row(self, feature, model=None):
            return paired_columns(feature)

    return DzPairedTrainer


def paired_columns(feature: dict[str, Any]) -> dict[str, Any]:
    """TRL's CPO/ORPO columns of one pair: each answer's sequence, mask and labels (-100 on the prompt)."""
    prompt = list(feature["prompt_ids"])
    out: dict[str, Any] = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side in ("chosen", "rejected"):
        answer = list(feature[f"{side}_ids"])
        out[f"{side}_input_ids"] = prompt + answer
        out[f"{side}_attention_mask"] = [1] * (len(prompt) + len(answer))
        out[f"{side}_labels"] = [-100] * len(prompt) + answer
    return out


def trainer_class(train: TrainSpec, dz_trainer: type):
    """The stage's TRL trainer with ``dz_trainer`` (``run.DzTrainer``) before it in the MRO."""
    if train.stage == "kto":
        from trl import KTOTrainer

        return _dpo_class(dz_trainer, KTOTrainer)
    if train.pref_loss == "simpo":
        from trl.experimental.cpo import CPOTrainer

        return _paired_class(dz_trainer, CPOTrainer)
    if train.pref_loss == "orpo":
        from trl.experimental.orpo import ORPOTrainer

        return _paired_class(dz_trainer, ORPOTrainer)
    from trl import DPOTrainer

    return _dpo_class(dz_trainer, DPOTrainer)


def as_dataset(examples: list[dict[str, Any]] | Dataset | None, train: TrainSpec) -> Dataset | None:
    """The tokenized rows as a ``datasets.Dataset`` (CPO/ORPO's maps read text columns: empty ones are given).

    A ``Dataset`` (the node's mapped cache: ``stage.load_data``) is used as it is, never copied."""
    if examples is None:
        return None
    data = examples if isinstance(examples, Dataset) else Dataset.from_list(examples)
    if train.stage == "dpo" and train.pref_loss in ("simpo", "orpo"):
        empty = [""] * len(data)
        data = data.add_column("prompt", empty).add_column("chosen", empty).add_column("rejected", empty)
    return data


def drop_reference_adapter(trainer) -> None:
    """LoRA: TRL adds a "ref" copy of the adapter to a PEFT model; the reference is the base, adapters off.

    A fresh adapter (B = 0) leaves the base unchanged, so the copy is the base itself at one
    more adapter's memory and one more fetch per layer under ZeRO-3. Without it TRL computes the
    reference with the adapters disabled (``use_adapter(model, None)``).
    """
    model = trainer.model
    config = getattr(model, "peft_config", None)
    if config and "ref" in config:
        model.delete_adapter("ref")
        model.set_adapter("default")
