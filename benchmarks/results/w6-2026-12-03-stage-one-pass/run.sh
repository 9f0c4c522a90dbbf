#!/bin/bash
# W6, 2 stages, stream interval 16: the working tree (after) and BEFORE (a git archive of
# 69f9ba2 with the generated protos) alternating; results into OUT.
for r in 1 2 3; do
  for side in after before; do
    dir=$PWD; [ $side = before ] && dir=$BEFORE
    for seqs in 64 256; do
      [ $seqs = 256 ] && [ $r = 3 ] && continue
      (cd $dir && timeout 300 python -m benchmarks.control_plane --stages 2 --seqs $seqs \
        --window 8 --stream-interval 16 --out $OUT/${side}_s${seqs}_r$r.json)
    done
  done
done
