#!/usr/bin/env bash
# Reproduces tandem's fortune model (model/fortune) from Debian's fortunes
# packages, in three steps:
#
#   scripts/train-fortune.sh prepare BUILD    # Debian 12 with python3-regex: download the
#                                             # packages, build the corpus and train the tokenizer
#   scripts/train-fortune.sh train BUILD OUT  # a GPU machine with torch, transformers and
#                                             # tokenizers: train, check, record goldens
#   scripts/train-fortune.sh install OUT      # OUT/fortune.tar into model/fortune
#
# The train step ran on one H200 (torch 2.11, transformers 5.17) in about
# two minutes; see model/fortune/checkpoint/README.md for what came out.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")

# The packages the model is trained on, as Debian 12 ships them.
version=1:1.99.1-7.3
declare -A sha256=(
	[fortunes]=41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5
	[fortunes-min]=9eed5b45064e41133dae0967cf3a17588ad77c014fcc7bf1527fa3ea48e44d07
)

case "${1:-}" in
prepare)
	build=${2:?usage: $0 prepare BUILD}
	mkdir -p "$build/debs" "$build/root"
	for p in fortunes fortunes-min; do
		(cd "$build/debs" && apt-get download "$p=$version")
		deb=$(ls "$build"/debs/"$p"_*.deb)
		echo "${sha256[$p]}  $deb" | sha256sum -c -
		dpkg-deb -x "$deb" "$build/root"
	done
	python3 "$here/train-fortune/prepare.py" "$build/root" "$build"
	;;
train)
	build=${2:?usage: $0 train BUILD OUT}
	out=${3:?usage: $0 train BUILD OUT}
	mkdir -p "$out"
	PYTHONUNBUFFERED=1 python3 "$here/train-fortune/train.py" "$build" "$out" 2>&1 | tee "$out/train.log"
	;;
install)
	out=${2:?usage: $0 install OUT}
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	tar -xf "$out/fortune.tar" -C "$tmp"
	dst=$repo/model/fortune
	cp "$tmp"/fortune/checkpoint/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json} "$dst/checkpoint/"
	chmod 644 "$dst"/checkpoint/*
	cp "$tmp/fortune/golden.json" "$dst/testdata/golden.json"
	cp "$tmp/fortune/training.json" "$dst/training.json"
	echo "installed into $dst (update checkpoint/README.md with the figures of training.json)"
	;;
*)
	sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
	exit 2
	;;
esac
