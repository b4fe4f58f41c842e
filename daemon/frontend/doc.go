// Package frontend is the leader's request frontend: it owns a request's
// text for every API. It validates a gRPC request against the model (each
// refusal INVALID_ARGUMENT naming the field), fills the sampling fields a
// request leaves unset from the checkpoint's generation_config.json,
// encodes a text prompt, submits the request to the engine (the leader's
// scheduler, which deals in tokens only), and streams the completion back
// through one output processor per request (package textout: incremental
// detokenisation, stop strings, text held back while it may begin one).
// When the output is complete (a stop token, a stop string, the length
// limit) or the client leaves, the request is cancelled, which frees its KV
// cache at once.
//
// Server implements tandem.v1.Inference; GenerateTo is the same path for
// any other API in front of it, and OpenAI is the engine of the OpenAI HTTP
// API (package openai), whose domain errors it maps onto that package's
// (the one place this is decided).
//
// Metrics records every request of every API: vLLM's request-level set
// (time to first token, inter-token latency, end-to-end, queue, prefill,
// decode and inference time; prompt and generation tokens; requests
// finished by reason; requests running and waiting, KV-cache usage,
// preemptions) under tandem's names, and vLLM's too when asked
// (MetricNames lists the mapping). Its counters and histograms live as
// long as the process.
//
// # Usage
//
//	m := frontend.NewMetrics(frontend.MetricsConfig{ModelName: "llama", Engine: statsNow, Counters: &counters})
//	fe := frontend.New(frontend.Config{Model: ckpt.Config(), Tokenizer: tok, Generation: gen, Chat: set,
//		Name: "llama", Engines: engines, Metrics: m})
//	tandemv1.RegisterInferenceServer(srv, fe)
//	api := openai.New(openai.Config{Engine: fe.OpenAI()})
//
// # Concurrency
//
// A Server is safe for concurrent use: each request runs on its own RPC or
// HTTP handler goroutine and reads its token stream from the engine, which
// never waits for it. Metrics are safe for concurrent use.
package frontend
