// Package openai serves the OpenAI-compatible HTTP API over the leader's
// engine, so the clients users already have (the openai libraries,
// LangChain, LiteLLM, Open WebUI, benchmark harnesses) work unchanged.
//
// Routes:
//
//	POST /v1/chat/completions  chat, rendered with the model's chat template (model/chat)
//	POST /v1/completions       text completion of a prompt (text or token ids)
//	GET  /v1/models            the served model (and /v1/models/{id})
//	GET  /health               200 while serving, 503 otherwise
//	POST /tokenize             vLLM's: a prompt or messages to token ids
//	POST /detokenize           vLLM's: token ids to text
//	GET  /metrics              when Config.Metrics is set
//
// Completions stream as server-sent events ("data: {json}" and a blank
// line per event, "data: [DONE]" last) when stream is true, with a usage
// chunk when stream_options.include_usage is. Requests take max_tokens and
// max_completion_tokens, temperature, top_p, top_k, seed, stop (a string or
// a list), n (1 only), logprobs and top_logprobs, ignore_eos,
// stop_token_ids, skip_special_tokens, and for chat tools (rendered by the
// template; tool calls are not parsed from the output),
// chat_template_kwargs, add_generation_prompt and continue_final_message.
// Sampling fields a request leaves unset take the checkpoint's
// generation_config.json values (Model.Defaults), then OpenAI's defaults
// (temperature 1, top_p 1, no top-k); the request always wins. A seed left
// unset is drawn at random.
//
// The engine owns the output's text (the request frontend, through
// daemon/textout, for every API): incremental detokenisation, stop strings
// (the text ends before the first to appear; the generation is cancelled
// at once), text that may begin a stop held back; each Token carries the
// text it releases. finish_reason is "stop" (a stop token or string) or
// "length"; usage counts every generated token, a stop token included, as
// vLLM does. logprobs and top_logprobs go up to stage.MaxLogprobs.
//
// Errors use OpenAI's shape, {"error": {"message", "type", "param",
// "code"}}: 400 for a bad field (param names it) or a chat template that
// fails, 404 for an unknown model, 429 when the engine's queue is full
// (ErrOverloaded), 503 when no pipeline serves or the node drains
// (ErrUnavailable). A client that disconnects cancels its generation at
// once: the request's context is the generation's, and a handler that
// returns closes its Stream.
//
// # Usage
//
//	api := openai.New(openai.Config{Engine: eng, Logger: log, Metrics: promhttp.Handler()})
//	srv := &http.Server{Handler: api}
//	go srv.Serve(listener) // the caller owns the listener and the server
//
// # Concurrency
//
// A Server serves any number of requests at once; each request's
// generation runs on its handler's goroutine. The Engine must be safe for
// concurrent use.
package openai
