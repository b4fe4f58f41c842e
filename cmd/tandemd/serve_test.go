package main

import (
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/tandem-llm/tandem/daemon"
)

// TestServeFlagsOverrideConfig checks how tandemd serve combines its
// configuration file with its flags: a flag given on the command line
// replaces its key, every other key keeps the file's value (a flag's own
// default never does), and without a file the flags' defaults apply.
func TestServeFlagsOverrideConfig(t *testing.T) {
	parse := func(args ...string) daemon.Config {
		t.Helper()
		var o serveFlags
		fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
		o.register(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		cfg, err := o.resolve(fs)
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	cfg := parse("--config", "../../daemon/testdata/tandemd.toml",
		"--grpc", "127.0.0.1:9999", "--max-seqs", "8", "--handoff=true", "--memory", "2GiB", "--stage=false", "--seeds", "10.0.0.9:7401",
		"--recovery-timeout", "5s", "--auto-rebalance=false")
	// Given flags win.
	if cfg.Listen.GRPC != "127.0.0.1:9999" || cfg.Stage.MaxSeqs != 8 || cfg.Stage.Handoff == nil || !*cfg.Stage.Handoff ||
		time.Duration(cfg.Cluster.RecoveryTimeout) != 5*time.Second || cfg.Cluster.AutoRebalance == nil || *cfg.Cluster.AutoRebalance ||
		cfg.Stage.Memory != 2<<30 || cfg.Stage.Enabled == nil || *cfg.Stage.Enabled ||
		len(cfg.Cluster.Seeds) != 1 || cfg.Cluster.Seeds[0] != "10.0.0.9:7401" {
		t.Errorf("flags did not override the file: %+v", cfg)
	}
	// The file's other keys stay, though the flags have defaults of their own.
	if cfg.Name != "node-a" || cfg.Cluster.ExpectStages != 2 || cfg.Stage.BlockSize != 32 || cfg.Stage.GraphMode != "PIECEWISE" ||
		cfg.Listen.Metrics != "127.0.0.1:9400" || cfg.Stage.MaxBatchTokens != 512 || cfg.Stage.Backend != "cuda" || time.Duration(cfg.Cluster.StepTimeout) != 30*time.Second ||
		cfg.Listen.HTTP != "127.0.0.1:8000" || cfg.ModelName != "llama-3.1-8b-instruct" || !cfg.Metrics.VLLMNames || cfg.Stage.CompensatedTokens != 32 {
		t.Errorf("keys of the file lost to flag defaults: %+v", cfg)
	}
	cfg = parse("--config", "../../daemon/testdata/tandemd.toml", "--http", "0.0.0.0:8080", "--model-name", "m", "--vllm-metric-names=false")
	if cfg.Listen.HTTP != "0.0.0.0:8080" || cfg.ModelName != "m" || cfg.Metrics.VLLMNames || cfg.Cluster.BalanceByTimeAfter != 0 {
		t.Errorf("--http, --model-name, --vllm-metric-names did not override the file: %+v", cfg)
	}
	cfg = parse("--config", "../../daemon/testdata/tandemd.toml", "--balance-by-time-after", "90s", "--compensated-tokens", "-1")
	if time.Duration(cfg.Cluster.BalanceByTimeAfter) != 90*time.Second || cfg.Stage.CompensatedTokens != -1 {
		t.Errorf("--balance-by-time-after 90s --compensated-tokens -1: cluster.balance_by_time_after %v, stage.compensated_tokens %d",
			time.Duration(cfg.Cluster.BalanceByTimeAfter), cfg.Stage.CompensatedTokens)
	}
	// Without a file, the flags and their defaults are the configuration.
	cfg = parse("--name", "n", "--model", "/m", "--block-size", "8")
	if cfg.Name != "n" || cfg.Model != "/m" || cfg.Stage.BlockSize != 8 || cfg.Listen.GRPC != daemon.DefaultGRPCAddr ||
		cfg.Stage.MaxSeqs != daemon.DefaultMaxSeqs || cfg.Cluster.ExpectStages != 1 || cfg.Stage.Enabled == nil || !*cfg.Stage.Enabled ||
		cfg.Stage.CompensatedTokens != daemon.DefaultCompensatedTokens {
		t.Errorf("flags alone: %+v", cfg)
	}
}
