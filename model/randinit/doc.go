// Package randinit writes random-weight checkpoints in exactly the Hugging
// Face layout, so tandem can be developed and tested end to end without
// downloading a model.
//
// A checkpoint is config.json (as transformers 5 writes it: "dtype",
// "rope_parameters"), generation_config.json (sampling defaults
// GenTemperature, GenTopP, GenTopK and the EOS id), tokenizer.json,
// tokenizer_config.json (with ChatTemplate) and safetensors weights, one file or shards behind
// model.safetensors.index.json. Weights are drawn, in parallel, from PCG
// streams keyed by Options.Seed, the tensor's name and the index of each
// 65536-element chunk: projections, embeddings and biases
// from N(0, 0.02) as transformers initialises them, norm weights from
// 1 + N(0, 0.1) so that a skipped norm changes results. A tensor's values do
// not depend on sharding.
//
// The tokenizer is a byte-level BPE in the GPT-2 / Llama 3 style: the 256
// byte symbols (id = byte value), merges learned deterministically on an
// embedded English text (corpus.txt) until the vocabulary reaches
// Vocab - 2, then the special tokens <|begin_of_text|> (BOS, id Vocab-2) and
// <|end_of_text|> (EOS, id Vocab-1). If the text runs out of merges first,
// the ids between are filled with <|reserved_special_token_N|> added
// tokens, as Llama 3 does. The post-processor prepends BOS.
//
// Usage:
//
//	o := randinit.DefaultOptions() // 4 layers, hidden 64, vocab 512
//	o.ShardBytes = 64 << 10        // optional: shard the weights
//	err := randinit.Write(dir, o)
//	ck, err := model.Open(dir)
//
// Concurrency: Write keeps no shared state; concurrent calls must use
// different directories.
package randinit
