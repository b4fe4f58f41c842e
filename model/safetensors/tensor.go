package safetensors

// DType is a safetensors element type name as it appears in the header.
type DType string

// Element types tandem reads.
const (
	F32  DType = "F32"
	F16  DType = "F16"
	BF16 DType = "BF16"
)

// Tensor is one tensor of a safetensors file. Data aliases the file's memory
// map: it is valid until the file is closed and must not be written.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	Data  []byte
}
