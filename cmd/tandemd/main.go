package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newRootCmd().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "tandemd:", err)
		os.Exit(1)
	}
}

// logLevel is the least level logged, from --log-level and --verbose.
var logLevel slog.LevelVar

// newLogger logs text lines to w at logLevel.
func newLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: &logLevel}))
}

func newRootCmd() *cobra.Command {
	var (
		verbose   bool
		levelName string
	)
	root := &cobra.Command{
		Use:           "tandemd",
		Short:         "tandem node daemon: serves a language model by pipeline parallelism",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			var level slog.Level
			if err := level.UnmarshalText([]byte(levelName)); err != nil {
				return fmt.Errorf("--log-level %q: want debug, info, warn or error", levelName)
			}
			if verbose {
				level = slog.LevelDebug
			}
			logLevel.Set(level)
			slog.SetDefault(newLogger(os.Stderr))
			return nil
		},
	}
	root.PersistentFlags().BoolVarP(&verbose, "verbose", "v", false, "log debug messages to stderr (same as --log-level debug)")
	root.PersistentFlags().StringVar(&levelName, "log-level", "info", "least level logged to stderr: debug, info, warn or error")
	root.AddCommand(newServeCmd(), newDemoCmd())
	return root
}
