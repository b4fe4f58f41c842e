// Package textout is the output side of a request's text, shared by every
// API of the request frontend (gRPC Generate, OpenAI HTTP): it turns the
// generated token ids into text deltas by incremental detokenisation,
// applies stop strings, and holds back text that may still turn into a
// stop string, so a client never receives text that a stop later takes
// back. The scheduler deals in tokens only: when a stop string appears,
// the Processor reports it and the caller cancels the request.
//
// Semantics follow vLLM: the output ends right before the first stop
// string to appear while streaming (the text is cut at its first
// occurrence); a stop token (EOS, stop_token_ids) ends the output without
// its text; special tokens are left out of the text unless KeepSpecial.
//
// # Usage
//
//	p := textout.New(tok, textout.Config{Stop: []string{"\n\n"}})
//	for out := range tokens {
//		if out.EndedOnStopToken {
//			send(p.Finish())
//			break
//		}
//		d := p.Add(out.Token)
//		send(d.Text)
//		if d.Stopped {
//			cancel() // frees the request in the scheduler
//			break
//		}
//		if out.EndedByLength {
//			send(p.Finish())
//		}
//	}
//
// # Concurrency
//
// A Processor belongs to one request's goroutine. Processors may share a
// Tokenizer.
package textout
