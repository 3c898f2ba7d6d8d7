#!/usr/bin/env bash
# The tree of one commit under .repro/ (ignored by git), for device calls that must all run the
# reproduction's pinned commit whatever main holds now (experiments/notes/reproduction.md):
#   tools/repro_tree.sh <sha>      then run(carry=[".repro"]): bash experiments/run_h200.sh repro
set -euo pipefail
sha=$(git rev-parse --verify "${1:?usage: tools/repro_tree.sh <commit>}^{commit}")
rm -rf .repro
mkdir .repro
git archive "$sha" | tar -x -C .repro
echo "$sha" > .repro/COMMIT
echo ".repro/ holds $sha ($(du -sh .repro | cut -f1))"
