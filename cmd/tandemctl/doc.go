// Command tandemctl is tandem's operator and user tool: it shows a
// cluster's status and CUDA-graph dispatch, moves its pipeline live
// (rebalance, drain, undrain), completes prompts through the leader's gRPC
// API, chats with the served model through the OpenAI HTTP API (chat),
// measures its throughput and latency, records the leader's steps as a
// Chrome trace, writes random-init checkpoints, renders conversations with
// a chat template and checks prompts against a tokenizer. The leader's
// address comes from --addr or $TANDEM_ADDR, the admin token from --token
// or $TANDEM_TOKEN (chat takes the API's --url instead).
//
// # Concurrency
//
// Every subcommand makes one call (or one stream) at a time on the
// calling goroutine, bounded by --timeout when it is set, except bench,
// which runs --concurrency streaming calls on goroutines of its own over
// one connection and waits for all of them before it prints.
package main
