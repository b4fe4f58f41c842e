package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
)

// WriteTensor is one tensor to write. Exactly one of Data and Stream is set.
type WriteTensor struct {
	Name  string
	DType DType
	Shape []int
	// Data holds the little-endian elements.
	Data []byte
	// Stream, when Data is nil, writes the elements to w; it must write
	// exactly the size Shape and DType give. It lets a writer produce
	// tensors larger than it wants to hold in memory.
	Stream func(w io.Writer) error
}

// Bytes is the size of the tensor's data.
func (t *WriteTensor) Bytes() int64 {
	n := int64(t.DType.Size())
	for _, d := range t.Shape {
		n *= int64(d)
	}
	return n
}

// Write writes a safetensors file holding tensors and, when it is not empty,
// metadata. The output is deterministic: tensors are laid out in name order,
// the header's keys are sorted, and the header is padded with spaces so the
// data section starts at a multiple of 8 bytes.
func Write(w io.Writer, tensors []WriteTensor, metadata map[string]string) error {
	sorted := make([]*WriteTensor, len(tensors))
	for i := range tensors {
		sorted[i] = &tensors[i]
	}
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Name < sorted[j].Name })

	type entry struct {
		DType       DType    `json:"dtype"`
		Shape       []int    `json:"shape"`
		DataOffsets [2]int64 `json:"data_offsets"`
	}
	header := map[string]any{}
	if len(metadata) > 0 {
		header[metadataKey] = metadata
	}
	var off int64
	for i, t := range sorted {
		if err := checkWriteTensor(t); err != nil {
			return fmt.Errorf("write safetensors: %w", err)
		}
		if i > 0 && sorted[i-1].Name == t.Name {
			return fmt.Errorf("write safetensors: duplicate tensor %q", t.Name)
		}
		n := t.Bytes()
		shape := t.Shape
		if shape == nil {
			shape = []int{}
		}
		header[t.Name] = entry{t.DType, shape, [2]int64{off, off + n}}
		off += n
	}
	var js bytes.Buffer
	enc := json.NewEncoder(&js)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(header); err != nil {
		return fmt.Errorf("write safetensors: encode header: %w", err)
	}
	js.Truncate(js.Len() - 1) // Encode's newline
	for (8+js.Len())%8 != 0 {
		js.WriteByte(' ')
	}
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(js.Len()))
	if _, err := w.Write(lenBuf[:]); err != nil {
		return fmt.Errorf("write safetensors header: %w", err)
	}
	if _, err := w.Write(js.Bytes()); err != nil {
		return fmt.Errorf("write safetensors header: %w", err)
	}
	for _, t := range sorted {
		if t.Data != nil {
			if _, err := w.Write(t.Data); err != nil {
				return fmt.Errorf("write safetensors tensor %q: %w", t.Name, err)
			}
			continue
		}
		cw := &countingWriter{w: w}
		if err := t.Stream(cw); err != nil {
			return fmt.Errorf("write safetensors tensor %q: %w", t.Name, err)
		}
		if cw.n != t.Bytes() {
			return fmt.Errorf("write safetensors tensor %q: stream wrote %d bytes, want %d", t.Name, cw.n, t.Bytes())
		}
	}
	return nil
}

func checkWriteTensor(t *WriteTensor) error {
	switch {
	case t.Name == "":
		return errors.New("tensor with an empty name")
	case t.Name == metadataKey:
		return fmt.Errorf("tensor name %q is reserved", t.Name)
	case t.DType.Size() == 0:
		return fmt.Errorf("tensor %q: unknown dtype %q", t.Name, t.DType)
	case (t.Data == nil) == (t.Stream == nil):
		return fmt.Errorf("tensor %q: exactly one of Data and Stream must be set", t.Name)
	}
	for _, d := range t.Shape {
		if d < 0 {
			return fmt.Errorf("tensor %q: shape %v has a negative dimension", t.Name, t.Shape)
		}
	}
	if t.Data != nil && int64(len(t.Data)) != t.Bytes() {
		return fmt.Errorf("tensor %q: %d data bytes, shape %v of %s needs %d", t.Name, len(t.Data), t.Shape, t.DType, t.Bytes())
	}
	return nil
}

// countingWriter counts the bytes a Stream writes.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
