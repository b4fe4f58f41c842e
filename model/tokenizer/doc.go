// Package tokenizer reads a Hugging Face tokenizer.json and encodes and
// decodes text exactly as the Hugging Face tokenizers library (0.23) does
// with the same file: same ids, same decoded text.
//
// It implements the BPE model (byte-level as in GPT-2, Llama 3 and Qwen, and
// SentencePiece-style with byte fallback as in Llama 2 and Mistral) and the
// components those files use:
//
//   - normalizers NFC, NFD, NFKC, NFKD, Lowercase, Strip, Prepend, Replace
//     and Sequence;
//   - pre-tokenizers Split (every behavior, inverted or not), ByteLevel,
//     Metaspace and Sequence;
//   - post-processors TemplateProcessing, ByteLevel, RobertaProcessing,
//     BertProcessing and Sequence;
//   - decoders ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace and
//     Sequence;
//   - added tokens with their single_word, lstrip, rstrip, normalized and
//     special flags.
//
// Parse rejects a file using anything else, naming the component, rather
// than encode differently from the reference; once parsed, encoding and
// decoding cannot fail. The split expressions of
// GPT-2, Llama 3 and Qwen run on hand-written scanners; other expressions
// run on regexp2 (lookahead included). The file's truncation and padding
// settings are not applied: Encode returns every token, and limits on
// length are the caller's to enforce.
//
// # Usage
//
//	tok, err := tokenizer.Load("tokenizer.json")
//	if err != nil { ... }
//	ids := tok.Encode("Hello world", true) // with the file's special tokens
//	text := tok.Decode(ids, true)           // special tokens skipped
//
//	s := tok.NewStream(true) // incremental decoding of generated ids
//	for _, id := range generated {
//		fmt.Print(s.Add(id)) // only complete text, never a broken character
//	}
//	fmt.Print(s.Flush())
//
// # Concurrency
//
// A *Tokenizer is immutable after Parse apart from an internal, locked cache
// of encoded words: it is safe for concurrent use by any number of
// goroutines. A *Stream belongs to one goroutine; any number of Streams may
// share a Tokenizer.
package tokenizer
