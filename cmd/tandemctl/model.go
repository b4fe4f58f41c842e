package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/model/randinit"
)

func newModelCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "model", Short: "Work with model checkpoints"}
	cmd.AddCommand(newModelInitCmd())
	return cmd
}

func newModelInitCmd() *cobra.Command {
	o := randinit.DefaultOptions()
	var out string
	cmd := &cobra.Command{
		Use:   "init --out DIR",
		Short: "Write a random-init checkpoint in the Hugging Face layout",
		Long: `Write a random-init checkpoint (config.json, bf16 safetensors, a byte-level
BPE tokenizer.json) in exactly the Hugging Face layout, deterministic from
--seed. Tests use it; it needs no network.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := randinit.Write(out, o); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s checkpoint: %d layers, hidden %d, %d heads (%d kv), vocab %d, to %s\n",
				o.Arch, o.Layers, o.Hidden, o.Heads, o.KVHeads, o.Vocab, out)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&out, "out", "", "directory to write (required)")
	f.StringVar(&o.Arch, "arch", o.Arch, "architecture: llama or qwen2")
	f.IntVar(&o.Layers, "layers", o.Layers, "transformer layers")
	f.IntVar(&o.Hidden, "hidden", o.Hidden, "hidden size")
	f.IntVar(&o.Heads, "heads", o.Heads, "attention heads")
	f.IntVar(&o.KVHeads, "kv-heads", o.KVHeads, "key/value heads")
	f.IntVar(&o.Intermediate, "intermediate", o.Intermediate, "MLP intermediate size")
	f.IntVar(&o.Vocab, "vocab", o.Vocab, "vocabulary size")
	f.IntVar(&o.HeadDim, "head-dim", o.HeadDim, "attention head size (0: hidden / heads)")
	f.IntVar(&o.MaxPositions, "max-positions", o.MaxPositions, "context length")
	f.BoolVar(&o.Tied, "tied", o.Tied, "share the embedding with the LM head")
	f.BoolVar(&o.RopeScaling, "rope-scaling", o.RopeScaling, "llama3 rope scaling")
	f.Int64Var(&o.ShardBytes, "shard-bytes", o.ShardBytes, "split weights into shards of at most this many bytes (0: one file)")
	f.StringVar(&o.DType, "dtype", o.DType, "weight type: bf16, f16 or f32")
	f.Uint64Var(&o.Seed, "seed", o.Seed, "random seed")
	cmd.MarkFlagRequired("out")
	return cmd
}
