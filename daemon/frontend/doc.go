// Package frontend is the leader's request frontend: it owns a request's
// text for every API. It validates a request against the model (each
// refusal INVALID_ARGUMENT naming the field), encodes a text prompt,
// submits the request to the engine (the leader's scheduler), and streams
// the completion back: token ids, log-probabilities, and text decoded
// incrementally with stop strings applied (text that may begin a stop
// string is held back until it is known not to; the scheduler ends the
// request on the token that completes one, freeing its KV cache at once).
//
// Server implements tandem.v1.Inference; GenerateTo is the same path for
// any other API in front of it.
//
// # Usage
//
//	fe := frontend.New(ckpt.Config(), tok, engines) // engines: the daemon
//	tandemv1.RegisterInferenceServer(srv, fe)
//
// # Concurrency
//
// A Server is safe for concurrent use: each Generate call runs on its own
// RPC goroutine and reads its request's token stream from the engine,
// which never waits for it.
package frontend
