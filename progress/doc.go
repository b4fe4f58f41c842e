// Package progress shows a person how long operations advance (loading a
// stage's weights, compiling kernels, capturing CUDA graphs, moving a
// stage): on a terminal, a bar per operation with its amount and
// rate (github.com/vbauerster/mpb/v8); otherwise, structured log lines
// when an operation starts, every few seconds while it runs, and when it
// ends or fails.
//
// The packages doing the work do not import this one: each takes a plain
// function where it is configured (model.Checkpoint.Counted's report,
// stage/cuda's Config.Progress), and the daemon, which chooses bars or
// log lines, passes Task.Set or Steps.Step.
//
// Usage:
//
//	r := progress.New(progress.Config{Mode: progress.Auto, Out: os.Stderr, Log: log})
//	logger := slog.New(slog.NewTextHandler(r.Writer(), nil)) // log lines above the bars
//	t := r.Start("load layers [0,16)", progress.Bytes, total, "node", name)
//	t.Set(done, 0) // as work advances
//	t.End(err)     // done, or failed
//
//	steps := r.Steps(progress.Count, "node", name)
//	cfg.Progress = steps.Step // the component reports its steps by name
//	...
//	steps.End(err)            // ends the steps the component left open
//
// Concurrency: a Reporter, its Tasks and Steps are safe for concurrent
// use. While bars are shown a container goroutine draws them; it ends when
// the last open operation ends, before that End returns.
package progress
