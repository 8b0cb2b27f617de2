#!/usr/bin/env bash
# Apply a MiniStream patch set to a vLLM source tree, all or nothing.
#
#   apply_patch.sh TREE PATCH_SET
#
# TREE is the directory that holds the vllm/ package (a checkout's root, or a
# tree extracted from a release wheel). PATCH_SET (e.g. patches/v0.32.0) holds:
#   *.diff   git-style diffs with paths relative to TREE, applied with `git apply`;
#            model.diff is a copy diff: TREE's llama.py + model.diff -> ministream.py
#   files/   new files of this patch set only, copied to the same relative path under TREE
#   upstream/  the rest of an upstream pull request: *.diff and files/ for vLLM's tests/ and
#            docs/ (the example-model entry, the supported-models row, a generation test);
#            applied when TREE is a source tree (has tests/), left out for a bare vllm/ package
# and every patch set adds the files of PATCH_SET/../common/files/ (stored once) the same way.
# Everything is checked first (`git apply --check`, no added file already
# present); on any failure this prints the file and hunk at fault, exits 1 and
# leaves TREE untouched.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 TREE PATCH_SET" >&2
    exit 2
fi
TREE=$(cd "$1" && pwd)
PATCH_SET=$(cd "$2" && pwd)

source_tree=0
[[ -d $TREE/tests ]] && source_tree=1
shopt -s nullglob
diffs=("$PATCH_SET"/*.diff)
if [[ $source_tree -eq 1 ]]; then
    diffs+=("$PATCH_SET"/upstream/*.diff)
fi
shopt -u nullglob
if [[ ${#diffs[@]} -eq 0 ]]; then
    echo "error: no *.diff in $PATCH_SET" >&2
    exit 1
fi
if [[ ! -d $TREE/vllm ]]; then
    echo "error: $TREE has no vllm/ package: pass the root of a vLLM source tree" >&2
    exit 1
fi

# Stop git from finding a repository above TREE: inside another repository
# `git apply` would silently skip paths outside the current directory.
export GIT_CEILING_DIRECTORIES=$(dirname "$TREE")
cd "$TREE"

# 1. check, changing nothing
failed=0
if ! check=$(git apply --check --verbose "${diffs[@]}" 2>&1); then
    # git names the file and the line its failing hunk starts at:
    #   error: patch failed: vllm/model_executor/models/registry.py:164
    echo "$check" | grep -E '^error: ' | grep -v 'while searching for' >&2 || echo "$check" >&2
    # name the hunk too: the one in that file's diff starting at that line
    echo "$check" | sed -nE 's/^error: patch failed: (.*):([0-9]+)$/\1 \2/p' |
        while read -r path line; do
            awk -v path="$path" -v line="$line" '
                /^diff --git / { sub(/^a\//, "", $3); file = $3; n = 0; next }
                /^@@ / { n++; split($2, old, ","); if (file == path && substr(old[1], 2) == line)
                         printf "error: %s: hunk #%d does not apply: %s (%s)\n", path, n, $0, FILENAME }
            ' "${diffs[@]}" >&2
        done
    echo "error: the patch set $PATCH_SET does not apply to $TREE (see the file and hunk above); nothing was changed" >&2
    failed=1
fi
new_files=()  # "folder<TAB>relative path" of each file to add
folders=("$(dirname "$PATCH_SET")/common/files" "$PATCH_SET/files")
if [[ $source_tree -eq 1 ]]; then
    folders+=("$PATCH_SET/upstream/files")
fi
for folder in "${folders[@]}"; do
    [[ -d $folder ]] || continue
    while IFS= read -r -d '' f; do
        rel=${f#"$folder/"}
        new_files+=("$folder"$'\t'"$rel")
        if [[ -e $TREE/$rel ]]; then
            echo "error: $TREE/$rel already exists; the patch set adds it (is the tree already patched?)" >&2
            failed=1
        fi
    done < <(find "$folder" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z)
done
if [[ $failed -ne 0 ]]; then
    exit 1
fi

# 2. apply: git apply is atomic over all the diffs it is given
git apply "${diffs[@]}"
for entry in "${new_files[@]}"; do
    folder=${entry%%$'\t'*}
    rel=${entry#*$'\t'}
    mkdir -p "$(dirname "$TREE/$rel")"
    cp "$folder/$rel" "$TREE/$rel"
done
what="vllm/ only (no tests/: not a source tree)"
[[ $source_tree -eq 1 ]] && what="vllm/, tests/ and docs/"
echo "applied $(basename "$PATCH_SET") to $TREE: ${#diffs[@]} diff(s), ${#new_files[@]} new file(s); $what"
