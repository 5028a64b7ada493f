#!/bin/bash
# Megatron-LM: a Llama-2-70B-shaped model, TP in the node and PP over 4 nodes, on 64 GPUs
#   python -m course_lib.job llama2_70b.sh --gpus 64
torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 \
    --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights --vocab-size 32000 \
    --seq-length 4096 --max-position-embeddings 4096 \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel \
    --use-distributed-optimizer --overlap-grad-reduce \
    --micro-batch-size 1 --global-batch-size 256 \
    --recompute-granularity selective --bf16 \
    --lr 3e-4 --clip-grad 1.0 --data-path my_corpus_text_document
