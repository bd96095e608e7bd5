#!/bin/sh
# Runs a worker as an NCCL host of its own (NCCL_HOSTID per rank), so that several ranks share one
# GPU and connect over NET/Socket as ranks of several nodes would (shared/reference/gpu-machine.md).
NCCL_HOSTID=h$RANK exec "$@"
