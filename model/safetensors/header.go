package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"sort"
)

// MaxHeaderSize caps the JSON header of a file (100 MiB, the cap the
// reference implementation uses), so a corrupt length cannot make a reader
// allocate without bound.
const MaxHeaderSize = 100 << 20

// metadataKey is the header entry holding free-form string metadata.
const metadataKey = "__metadata__"

// Header is the parsed, validated header of a safetensors file.
type Header struct {
	// DataOffset is where the data section starts in the file: 8 plus the
	// length of the JSON header.
	DataOffset int64
	// Raw is the JSON header as stored, padding included.
	Raw []byte
	// Metadata is the "__metadata__" entry (nil when absent).
	Metadata map[string]string
	// Tensors maps each tensor name to its entry.
	Tensors map[string]TensorInfo
}

// TensorInfo is one tensor's header entry. Begin and End are byte offsets
// into the data section.
type TensorInfo struct {
	DType      DType
	Shape      []int
	Begin, End int64
}

// Names lists the tensor names in sorted order.
func (h *Header) Names() []string {
	names := make([]string, 0, len(h.Tensors))
	for n := range h.Tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// ParseHeader reads and validates the header at the start of r, a file of
// fileSize bytes: the 8-byte little-endian length, then the JSON. It checks
// that every dtype is defined, every shape matches its byte range, every
// range lies inside the data section and no two ranges overlap. Gaps between
// tensors are allowed. ParseHeader reads at most 8+MaxHeaderSize bytes and
// never allocates more than that, whatever the input.
func ParseHeader(r io.Reader, fileSize int64) (*Header, error) {
	var lenBuf [8]byte
	if _, err := io.ReadFull(r, lenBuf[:]); err != nil {
		return nil, fmt.Errorf("read header length (file is %d bytes): %w", fileSize, err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > MaxHeaderSize {
		return nil, fmt.Errorf("header length %d exceeds the %d byte cap", n, MaxHeaderSize)
	}
	if fileSize < 8 || n > uint64(fileSize-8) {
		return nil, fmt.Errorf("header length %d exceeds the %d byte file", n, fileSize)
	}
	// ReadAll grows with what actually arrives, so a reader shorter than
	// fileSize claims cannot make us allocate the whole claimed length.
	raw, err := io.ReadAll(io.LimitReader(r, int64(n)))
	if err != nil {
		return nil, fmt.Errorf("read %d byte header: %w", n, err)
	}
	if uint64(len(raw)) != n {
		return nil, fmt.Errorf("read %d byte header: %w", n, io.ErrUnexpectedEOF)
	}
	return parseJSONHeader(raw, fileSize-8-int64(n))
}

// parseJSONHeader validates the JSON header raw of a file whose data section
// is dataLen bytes long.
func parseJSONHeader(raw []byte, dataLen int64) (*Header, error) {
	h := &Header{
		DataOffset: 8 + int64(len(raw)),
		Raw:        raw,
		Tensors:    map[string]TensorInfo{},
	}
	err := decodeObject(raw, func(name string, value json.RawMessage) error {
		if name == metadataKey {
			md, err := parseMetadata(value)
			if err != nil {
				return fmt.Errorf("%s: %w", metadataKey, err)
			}
			h.Metadata = md
			return nil
		}
		info, err := parseTensorInfo(value, dataLen)
		if err != nil {
			return fmt.Errorf("tensor %q: %w", name, err)
		}
		h.Tensors[name] = info
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("header: %w", err)
	}
	if err := checkOverlaps(h.Tensors); err != nil {
		return nil, fmt.Errorf("header: %w", err)
	}
	return h, nil
}

func parseMetadata(value json.RawMessage) (map[string]string, error) {
	if string(bytes.TrimSpace(value)) == "null" {
		return nil, nil
	}
	md := map[string]string{}
	err := decodeObject(value, func(k string, v json.RawMessage) error {
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			return fmt.Errorf("key %q: value is not a string", k)
		}
		md[k] = s
		return nil
	})
	return md, err
}

// rawTensorInfo mirrors a header entry; pointers tell missing fields apart.
type rawTensorInfo struct {
	DType       *string   `json:"dtype"`
	Shape       *[]int64  `json:"shape"`
	DataOffsets *[]uint64 `json:"data_offsets"`
}

func parseTensorInfo(value json.RawMessage, dataLen int64) (TensorInfo, error) {
	var ri rawTensorInfo
	if err := json.Unmarshal(value, &ri); err != nil {
		return TensorInfo{}, fmt.Errorf("entry: %w", err)
	}
	switch {
	case ri.DType == nil:
		return TensorInfo{}, errors.New("missing dtype")
	case ri.Shape == nil:
		return TensorInfo{}, errors.New("missing shape")
	case ri.DataOffsets == nil:
		return TensorInfo{}, errors.New("missing data_offsets")
	}
	dt := DType(*ri.DType)
	size := dt.Size()
	if size == 0 {
		return TensorInfo{}, fmt.Errorf("unknown dtype %q", *ri.DType)
	}
	offs := *ri.DataOffsets
	if len(offs) != 2 {
		return TensorInfo{}, fmt.Errorf("data_offsets has %d values, want 2", len(offs))
	}
	begin, end := offs[0], offs[1]
	if begin > end {
		return TensorInfo{}, fmt.Errorf("data_offsets [%d, %d] end before begin", begin, end)
	}
	if end > uint64(dataLen) {
		return TensorInfo{}, fmt.Errorf("data_offsets [%d, %d] beyond the %d byte data section", begin, end, dataLen)
	}
	shape := make([]int, len(*ri.Shape))
	// nbytes is computed in uint64 and capped at dataLen, so it cannot
	// overflow; a zero dimension makes the tensor empty whatever the others.
	nbytes := uint64(size)
	for i, d := range *ri.Shape {
		if d < 0 {
			return TensorInfo{}, fmt.Errorf("shape %v: dimension %d is negative", *ri.Shape, i)
		}
		shape[i] = int(d)
		if d == 0 {
			nbytes = 0
		}
	}
	if nbytes != 0 {
		for _, d := range *ri.Shape {
			hi, lo := bits.Mul64(nbytes, uint64(d))
			if hi != 0 || lo > uint64(dataLen) {
				return TensorInfo{}, fmt.Errorf("shape %v of %s is larger than the %d byte data section", *ri.Shape, dt, dataLen)
			}
			nbytes = lo
		}
	}
	if nbytes != end-begin {
		return TensorInfo{}, fmt.Errorf("shape %v of %s is %d bytes but data_offsets [%d, %d] span %d", *ri.Shape, dt, nbytes, begin, end, end-begin)
	}
	return TensorInfo{DType: dt, Shape: shape, Begin: int64(begin), End: int64(end)}, nil
}

// checkOverlaps rejects two tensors sharing bytes of the data section.
func checkOverlaps(tensors map[string]TensorInfo) error {
	type span struct {
		name       string
		begin, end int64
	}
	spans := make([]span, 0, len(tensors))
	for n, t := range tensors {
		if t.End > t.Begin {
			spans = append(spans, span{n, t.Begin, t.End})
		}
	}
	sort.Slice(spans, func(i, j int) bool {
		if spans[i].begin != spans[j].begin {
			return spans[i].begin < spans[j].begin
		}
		return spans[i].name < spans[j].name
	})
	for i := 1; i < len(spans); i++ {
		if p, s := spans[i-1], spans[i]; s.begin < p.end {
			return fmt.Errorf("tensor %q [%d, %d] overlaps tensor %q [%d, %d]", s.name, s.begin, s.end, p.name, p.begin, p.end)
		}
	}
	return nil
}

// decodeObject walks the JSON object data, calling fn for each member in
// order. Unlike encoding/json it rejects duplicate keys, which would let two
// readers of one file disagree, and anything after the object but
// whitespace.
func decodeObject(data []byte, fn func(key string, value json.RawMessage) error) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("invalid JSON: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return errors.New("not a JSON object")
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return fmt.Errorf("invalid JSON: %w", err)
		}
		key, ok := tok.(string)
		if !ok {
			return fmt.Errorf("invalid JSON: key %v is not a string", tok)
		}
		if seen[key] {
			return fmt.Errorf("duplicate key %q", key)
		}
		seen[key] = true
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return fmt.Errorf("key %q: invalid JSON: %w", key, err)
		}
		if err := fn(key, value); err != nil {
			return err
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return fmt.Errorf("invalid JSON: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("invalid JSON: data after the object")
	}
	return nil
}
