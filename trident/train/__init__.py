"""The trainer: FSDP2 policy ranks (``policy.PolicyWorker``) driven as one ``group.TrainerGroup``;
SFT (``sft``); batches, the critic, FSDP plumbing."""
