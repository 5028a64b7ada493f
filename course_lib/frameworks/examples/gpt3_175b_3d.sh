#!/bin/bash
# Megatron-LM: a GPT-3 175B-shaped model in 3D, as Narayanan et al. ran it (interleaved, v = 4)
#   python -m course_lib.job gpt3_175b_3d.sh --gpus 1024 --gpu "A100 80GB"
TP=8
PP=8

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --vocab-size 50257
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP
    --pipeline-model-parallel-size ${PP}
    --num-layers-per-virtual-pipeline-stage 3
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --recompute-granularity selective
    --bf16
    --lr 6.0e-5
    --train-iters 500000
)
torchrun --nproc_per_node 8 --nnodes 128 pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${TRAINING_ARGS[@]}
