// Command tandemd is the tandem node daemon.
//
// tandemd serve runs one node of a cluster (see package daemon): a stage
// of the pipeline, and the leader's gRPC API when it is chosen leader,
// with the OpenAI-compatible HTTP API when --http (listen.http) is set.
// Its configuration is a TOML file (--config) with flags overriding its
// keys; it prints "listening grpc=ADDR gossip=ADDR" (and " http=ADDR"
// with the HTTP API on) once its listeners are bound, so a parent process
// can find them.
//
// tandemd demo starts a local cluster of such processes on loopback (a
// leader and --stages stage daemons over the built-in model of package
// fortune, written to a temporary directory, or --model DIR), streams a
// completion through the API and stops the
// cluster; with --keep its leader serves the OpenAI API too, it prints
// "leader: HOST:PORT" and "openai: http://HOST:PORT/v1", and runs until
// interrupted.
//
// # Concurrency
//
// main cancels the command's context on SIGINT or SIGTERM. serve runs
// daemon.Run on one goroutine and returns what it returns: the daemon
// drains and stops everything it started before Run returns. demo starts
// each daemon as a child process with one goroutine reading its standard
// output, stops every child with SIGTERM (SIGKILL past a deadline) and
// waits for them all before it returns, so no process outlives it.
package main
