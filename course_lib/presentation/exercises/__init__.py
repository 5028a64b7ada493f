"""Checkers for the "your turn" exercises, one module per notebook. Each runs the learner's code for real and
says what is wrong.

A checker returns True when the answer is right. An unfinished answer (still raising NotImplementedError)
gets "Not done yet" instead of an error, so a notebook runs top to bottom before the learner has tried. The
reference answers are in course_lib/presentation/exercises/solutions.py, shown only to a learner who asks:
``exercises.solution("mean_over_ranks")``. common.py holds what the checkers share.
"""

from .checkpoints import check_global_norm as _check_global_norm
from .common import NOT_DONE as NOT_DONE
from .common import exercise
from .context import check_lse_merge as _check_lse_merge
from .ddp import check_accumulation_step as check_accumulation_step
from .experts import check_expert_exchange as _check_expert_exchange
from .incidents import check_fp16_step as _check_fp16_step
from .incidents import check_micro_batch_loss as _check_micro_batch_loss
from .incidents import check_pipeline_swap as _check_pipeline_swap
from .incidents import check_rank_rows as _check_rank_rows
from .incidents import check_replica_sync as _check_replica_sync
from .incidents import check_resume_load as _check_resume_load
from .incidents import check_step_count as _check_step_count
from .layout import check_3d_layout as _check_3d_layout
from .memory_ledger import check_mlp_saved_bytes as check_mlp_saved_bytes
from .pipeline import check_one_f_one_b as check_one_f_one_b
from .scale import OWN_JOB as OWN_JOB  # notebook 09's torchtitan file that does not fit
from .scale import check_layout_at_scale as _check_layout_at_scale
from .scale import check_own_job as _check_own_job
from .solutions import solution as solution  # exercises.solution(name): a learner who asks sees an answer
from .tensor_parallel import check_copy_to_tp_region as check_copy_to_tp_region
from .training_step import check_mean_over_ranks as check_mean_over_ranks
from .zero import check_reduce_grad_shard as check_reduce_grad_shard

# The later notebooks' checkers are plain functions in their modules (their tests call them so); wrapped here
# like the others, to offer the reference answer after a miss.
check_3d_layout = exercise(_check_3d_layout)
check_lse_merge = exercise(_check_lse_merge)
check_expert_exchange = exercise(_check_expert_exchange)
check_layout_at_scale = exercise(_check_layout_at_scale)
check_own_job = exercise(_check_own_job)
check_global_norm = exercise(_check_global_norm)
check_micro_batch_loss = exercise(_check_micro_batch_loss)
check_pipeline_swap = exercise(_check_pipeline_swap)
check_step_count = exercise(_check_step_count)
check_replica_sync = exercise(_check_replica_sync)
check_rank_rows = exercise(_check_rank_rows)
check_resume_load = exercise(_check_resume_load)
check_fp16_step = exercise(_check_fp16_step)
