#!/usr/bin/env bash
# fork_storm: a shell script that forks hundreds of short children per run, for the soak
# (scripts/soak.py, shape "forks").
#
# What it imitates: the glue of real pipelines: a bash job script (Slurm's, a cron job's, an Airflow
# BashOperator's) that computes with command substitutions, pipes through coreutils and calls expr in
# a loop. Such a tree is never the same for long: a checkpoint finds it in the middle of a fork, with a
# child that has not exec'd yet, with a pipeline half built, or with none at all, and a restore must
# bring back whichever it caught (the bash that waits on a child of a pid it knows) and let the next
# forks go on. Each step forks 30 to 50 children: $(...) subshells, `expr`, `printf | cksum` and
# `sort | head` pipelines.
#
# The state is in shell variables: a running checksum and a list of every step's value. Everything is
# computed from --seed with integer arithmetic (no $RANDOM, no time), so the digest depends only on the
# arguments, and a restored shell whose variables (or children's answers) came back wrong prints another.
#
#   bash fork_storm.sh --seed 1 --steps 150 --step-seconds 0.05
#
# Output: "start-up: ..." once, "step N/M" per step, "done digest=<16 hex>" last.
set -euo pipefail

seed=1 steps=100 step_seconds=0.05
while (($#)); do
    case "$1" in
        --seed) seed=$2 ;;
        --steps) steps=$2 ;;
        --step-seconds) step_seconds=$2 ;;
        *) echo "usage: $0 [--seed N] [--steps N] [--step-seconds S]" >&2; exit 2 ;;
    esac
    shift 2
done

echo "start-up: a shell forking its way through $steps steps (pid $$)"
M=4294967291  # a prime below 2^32: the running checksum stays in bash's 64-bit arithmetic
x=$(( (seed * 2654435761 + 12345) % M ))
sum=$(( seed % M ))
declare -a hist=()

next() { x=$(( (x * 1103515245 + 12345) % M )); }

for ((s = 1; s <= steps; s++)); do
    next
    n=$(( 30 + x % 21 ))
    for ((i = 0; i < n; i++)); do
        next
        case $(( (i + s) % 4 )) in
            0) v=$(expr "$x" % 100003 + "$i") ;;                                      # a program
            1) v=$(printf '%s:%s:%s' "$s" "$i" "$x" | cksum); v=${v%% *} ;;           # a pipeline
            2) v=$( (echo $((x % 9973)); echo $((i * 7 + s))) | sort -n | head -n 1) ;; # a subshell's pipeline
            3) v=$(y=$((x * 3 + i)); echo $((y % 7919))) ;;                           # a bare subshell
        esac
        sum=$(( (sum * 31 + v) % M ))
    done
    hist+=("$s:$sum")
    echo "step $s/$steps"
    if [[ $step_seconds != 0 && $step_seconds != 0.0 ]]; then sleep "$step_seconds"; fi
done
h=$(printf '%s\n' "${hist[@]}" | cksum)
printf 'done digest=%08x%08x\n' "$sum" "${h%% *}"
