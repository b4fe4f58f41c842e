// Package safetensors reads and writes the safetensors tensor format of
// Hugging Face checkpoints, single files and sharded sets.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON
// mapping tensor names to {"dtype", "shape", "data_offsets"} (plus an
// optional "__metadata__" object of strings), then the data section.
// ParseHeader validates a header completely — a length cap, the JSON,
// duplicate names, dtypes, shapes against byte ranges without overflow,
// ranges inside the data section and not overlapping — so nothing read
// afterwards can index out of bounds. Any dtype safetensors defines is
// accepted at parse; File.Tensor returns only F32, F16 and BF16 tensors,
// which Tensor.Float32 converts.
//
// Usage:
//
//	f, err := safetensors.Open("model.safetensors") // mmap, read-only
//	t, err := f.Tensor("model.norm.weight")         // t.Data aliases the map
//	w, err := t.Float32()
//	f.Close()                                       // t.Data is now invalid
//
//	s, err := safetensors.OpenIndex("dir/model.safetensors.index.json")
//	t, err := s.Tensor(name) // maps the tensor's shard on first use
//
//	err = safetensors.Write(w, []safetensors.WriteTensor{...}, metadata)
//
// Concurrency: File and Set are safe for concurrent use by several
// goroutines (Tensor, Names, Opened), except Close, which must not overlap
// any other call nor precede any use of a Tensor's Data. ParseHeader,
// ParseIndex and Write keep no state.
//
// Mapping uses golang.org/x/sys/unix, so the package builds on Unix only.
package safetensors
