package safetensors

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// File is a safetensors file mapped read-only into memory. Tensors returned
// by it alias the mapping and are valid until Close.
type File struct {
	path   string
	data   []byte // the whole mapping
	header *Header
}

// Open maps the file at path read-only and validates its header.
func Open(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open safetensors: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("open safetensors %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("open safetensors %s: not a regular file", path)
	}
	size := st.Size()
	if size < 8 {
		return nil, fmt.Errorf("open safetensors %s: %d bytes is too short to hold a header", path, size)
	}
	if int64(int(size)) != size {
		return nil, fmt.Errorf("open safetensors %s: %d bytes do not fit the address space", path, size)
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("open safetensors %s: mmap %d bytes: %w", path, size, err)
	}
	h, err := ParseHeader(bytes.NewReader(data), size)
	if err != nil {
		_ = unix.Munmap(data)
		return nil, fmt.Errorf("open safetensors %s: %w", path, err)
	}
	return &File{path: path, data: data, header: h}, nil
}

// Path is the path the file was opened with.
func (f *File) Path() string { return f.path }

// Header is the file's validated header. It must not be modified.
func (f *File) Header() *Header { return f.header }

// Names lists the file's tensor names in sorted order.
func (f *File) Names() []string { return f.header.Names() }

// Has reports whether the file holds a tensor called name.
func (f *File) Has(name string) bool {
	_, ok := f.header.Tensors[name]
	return ok
}

// Tensor returns the tensor called name. Its Data aliases the mapping. Only
// F32, F16 and BF16 tensors are returned; other dtypes, which a header may
// declare, are an error.
func (f *File) Tensor(name string) (*Tensor, error) {
	if f.data == nil {
		return nil, fmt.Errorf("safetensors %s: tensor %q: file is closed", f.path, name)
	}
	info, ok := f.header.Tensors[name]
	if !ok {
		return nil, fmt.Errorf("safetensors %s: no tensor %q", f.path, name)
	}
	if !info.DType.Float() {
		return nil, fmt.Errorf("safetensors %s: tensor %q has dtype %s; tandem reads F32, F16 and BF16", f.path, name, info.DType)
	}
	begin, end := f.header.DataOffset+info.Begin, f.header.DataOffset+info.End
	return &Tensor{
		Name:  name,
		DType: info.DType,
		Shape: slices.Clone(info.Shape),
		Data:  f.data[begin:end:end],
	}, nil
}

// Close unmaps the file. Tensors obtained from it must not be used after.
func (f *File) Close() error {
	if f.data == nil {
		return errors.New("safetensors " + f.path + ": already closed")
	}
	err := unix.Munmap(f.data)
	f.data = nil
	if err != nil {
		return fmt.Errorf("close safetensors %s: munmap: %w", f.path, err)
	}
	return nil
}
