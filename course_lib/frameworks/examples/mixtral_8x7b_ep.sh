#!/bin/bash
# Megatron-LM: Mixtral 8x7B with its experts spread over 8 GPUs (EP), 4 pipeline stages and each sequence
# over 4 GPUs (CP), on 64 GPUs
#   python -m course_lib.job mixtral_8x7b_ep.sh --gpus 64
torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 \
    --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall \
    --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights --vocab-size 32000 --rotary-base 1000000 \
    --seq-length 4096 --max-position-embeddings 32768 \
    --pipeline-model-parallel-size 4 --context-parallel-size 4 --use-distributed-optimizer \
    --micro-batch-size 1 --global-batch-size 256 \
    --recompute-granularity selective --bf16
