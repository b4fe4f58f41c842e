package gpu

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/tandem-llm/tandem/gpu/mockcuda"
)

// mockPath is the mock CUDA library built for this test run ("" when no C
// compiler is installed); mockErr says why not.
var (
	mockPath string
	mockErr  error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "gpu-mock")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	mockPath, mockErr = mockcuda.Build(dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// useMock initializes the package with the mock as every library and returns
// its controls. It skips the test when the mock cannot be built.
func useMock(t *testing.T) *mockcuda.Lib {
	t.Helper()
	if errors.Is(mockErr, mockcuda.ErrNoCompiler) {
		t.Skip("skipping: no C compiler to build the mock CUDA library")
	}
	if mockErr != nil {
		t.Fatal(mockErr)
	}
	m, err := mockcuda.Open(mockPath)
	if err != nil {
		t.Fatal(err)
	}
	m.Reset()
	resetState(t)
	if err := Init(Config{LibCUDA: mockPath, NVRTC: mockPath, CUBLAS: mockPath, NCCL: mockPath}); err != nil {
		t.Fatalf("Init with the mock: %v", err)
	}
	return m
}

// openMock opens device ordinal of the mock, closed at the end of the test.
func openMock(t *testing.T, ordinal int) *Device {
	t.Helper()
	d, err := Open(ordinal)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	return d
}

func TestMockDeviceInfo(t *testing.T) {
	useMock(t)
	n, err := DeviceCount()
	if err != nil || n != 2 {
		t.Fatalf("DeviceCount = %d, %v", n, err)
	}
	v, err := DriverVersion()
	if err != nil || v != 13000 {
		t.Fatalf("DriverVersion = %d, %v", v, err)
	}
	d := openMock(t, 1)
	want := DeviceInfo{Ordinal: 1, Name: "Mock GPU 1", Major: 9, Minor: 0, SMs: 132, TotalMem: 80 << 30, L2Bytes: 50 << 20, MaxSharedPerBlock: 48 << 10, MaxSharedPerBlockOptin: 227 << 10, UnifiedAddressing: true}
	if got := d.Info(); got != want {
		t.Fatalf("Info = %+v, want %+v", got, want)
	}
	if d.Info().Arch() != "sm_90" {
		t.Fatalf("Arch = %s", d.Info().Arch())
	}
	if _, err := Open(2); err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_INVALID_DEVICE") && !strings.Contains(err.Error(), "cuDeviceGet") {
		t.Fatalf("Open(2) = %v", err)
	}
}

func TestMockDoThread(t *testing.T) {
	useMock(t)
	d := openMock(t, 0)
	// Outside Do no context is current: the mock fails like the driver.
	_, err := Alloc(16)
	var e *Error
	if !errors.As(err, &e) || e.Name != "CUDA_ERROR_INVALID_CONTEXT" || e.Msg != "invalid device context" || e.Lib != "cuda" || e.Op != "cuMemAlloc" {
		t.Fatalf("Alloc outside Do = %v, want CUDA_ERROR_INVALID_CONTEXT from cuGetErrorName/String", err)
	}
	unlock, err := d.LockThread()
	if err != nil {
		t.Fatal(err)
	}
	m, err := Alloc(16)
	if err != nil {
		t.Fatalf("Alloc with the thread locked: %v", err)
	}
	if err := m.Free(); err != nil {
		t.Fatal(err)
	}
	unlock()
	if _, err := Alloc(16); err == nil {
		t.Fatal("context still current after unlock")
	}
	tids := map[int]bool{}
	for range 20 {
		if err := d.Do(func() error {
			tids[syscall.Gettid()] = true
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if len(tids) != 1 {
		t.Fatalf("Do ran on %d threads, want 1", len(tids))
	}
	sentinel := errors.New("sentinel")
	if err := d.Do(func() error { return sentinel }); err != sentinel {
		t.Fatalf("Do returned %v, want f's error", err)
	}
	func() {
		defer func() {
			p := recover()
			if p == nil || !strings.Contains(fmt.Sprint(p), "boom") {
				t.Fatalf("panic = %v, want the panic of f", p)
			}
		}()
		d.Do(func() error { panic("boom") })
	}()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Do(func() error { return nil }); !errors.Is(err, ErrClosed) {
		t.Fatalf("Do after Close = %v", err)
	}
}

func TestMockMemory(t *testing.T) {
	useMock(t)
	d := openMock(t, 0)
	err := d.Do(func() error {
		m, err := Alloc(1024)
		if err != nil {
			return err
		}
		defer m.Free()
		if m.Len() != 1024 || m.Slice(512, 256).Ptr() != m.Ptr()+512 {
			return fmt.Errorf("Mem %+v", m)
		}
		src := make([]float32, 256)
		for i := range src {
			src[i] = float32(i) * 0.5
		}
		if err := CopyHtoD(m.Ptr(), AsBytes(src)); err != nil {
			return err
		}
		s, err := NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()
		if err := MemsetD32Async(m.Ptr()+4*10, math.Float32bits(-1), 3, s); err != nil {
			return err
		}
		if err := MemsetD8Async(m.Ptr()+4*20, 0, 4, s); err != nil {
			return err
		}
		host, err := AllocHost(1024)
		if err != nil {
			return err
		}
		defer FreeHost(host)
		if err := CopyDtoHAsync(host, m.Ptr(), s); err != nil {
			return err
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		got := unsafe.Slice((*float32)(unsafe.Pointer(&host[0])), 256)
		for i, v := range got {
			want := src[i]
			if i >= 10 && i < 13 {
				want = -1
			}
			if i == 20 {
				want = 0
			}
			if v != want {
				return fmt.Errorf("element %d = %v, want %v", i, v, want)
			}
		}
		free, total, err := MemInfo()
		if err != nil || free != 70<<30 || total != 80<<30 {
			return fmt.Errorf("MemInfo = %d %d %v", free, total, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// vecAddSrc is what the GPU test compiles; the mock only echoes it.
const vecAddSrc = `extern "C" __global__ void vec_add(const float* a, const float* b, float* out, int n) {}`

func TestMockCompileLaunchGraph(t *testing.T) {
	m := useMock(t)
	d := openMock(t, 0)
	c, err := Compile(vecAddSrc, "vec_add.cu", "--gpu-architecture=sm_90", "-default-device", "-std=c++17")
	if err != nil {
		t.Fatal(err)
	}
	if c.PTX || !strings.HasPrefix(string(c.Image), "MOCKBIN") || m.LastOptions() != "--gpu-architecture=sm_90 -default-device -std=c++17" {
		t.Fatalf("compiled %q (ptx %v), options %q", c.Image, c.PTX, m.LastOptions())
	}
	ptx, err := Compile(vecAddSrc, "vec_add.cu", "--gpu-architecture=compute_90")
	if err != nil || !ptx.PTX || ptx.Image[len(ptx.Image)-1] != 0 {
		t.Fatalf("PTX fallback: %v %v", ptx.PTX, err)
	}
	_, err = Compile("#error nope", "bad.cu")
	var e *Error
	if !errors.As(err, &e) || e.Name != "NVRTC_ERROR_COMPILATION" || e.Detail != "mock.cu(1): error: boom" || !strings.Contains(err.Error(), "compile bad.cu") {
		t.Fatalf("failed compile error = %v", err)
	}
	if ma, mi, err := NVRTCVersion(); err != nil || ma != 13 || mi != 0 {
		t.Fatalf("NVRTCVersion = %d.%d %v", ma, mi, err)
	}

	const n = 1000
	err = d.Do(func() error {
		mod, err := LoadModule(c.Image)
		if err != nil {
			return err
		}
		defer mod.Unload()
		if _, err := LoadModule([]byte("garbage")); err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_INVALID_IMAGE") {
			return fmt.Errorf("bad image: %v", err)
		}
		if _, err := mod.Function("nope"); err == nil || !strings.Contains(err.Error(), `kernel "nope"`) || !strings.Contains(err.Error(), "CUDA_ERROR_NOT_FOUND") {
			return fmt.Errorf("missing kernel: %v", err)
		}
		fn, err := mod.Function("vec_add")
		if err != nil {
			return err
		}
		if err := fn.SetMaxDynamicSharedMem(100 << 10); err != nil {
			return err
		}
		if got := m.LastFuncAttr(); got != [3]int32{1, 8, 100 << 10} {
			return fmt.Errorf("cuFuncSetAttribute got %v", got)
		}
		if err := fn.SetSharedCarveout(100); err != nil {
			return err
		}
		if got := m.LastFuncAttr(); got != [3]int32{1, 9, 100} {
			return fmt.Errorf("cuFuncSetAttribute (carveout) got %v", got)
		}
		buf, err := Alloc(3 * 4 * n)
		if err != nil {
			return err
		}
		defer buf.Free()
		a, b, out := buf.Slice(0, 4*n), buf.Slice(4*n, 4*n), buf.Slice(8*n, 4*n)
		av, bv := make([]float32, n), make([]float32, n)
		for i := range av {
			av[i], bv[i] = rand.Float32(), rand.Float32()
		}
		if err := CopyHtoD(a.Ptr(), AsBytes(av)); err != nil {
			return err
		}
		if err := CopyHtoD(b.Ptr(), AsBytes(bv)); err != nil {
			return err
		}
		s, err := NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()
		var args KernelArgs
		args.Ptr(a.Ptr()).Ptr(b.Ptr()).Ptr(out.Ptr()).Int32(n)
		grid, block := Dim3{X: 4}, Dim3{X: 256}
		if err := fn.Launch(grid, block, 4096, s, &args); err != nil {
			return err
		}
		// Every one of the 11 arguments, five of them on the stack, as C
		// received them.
		got := m.LastLaunch()
		want := [11]uint64{got[0], 4, 1, 1, 256, 1, 1, 4096, uint64(s), got[9], 0}
		if got != want || got[9] == 0 {
			return fmt.Errorf("cuLaunchKernel received %v, want %v", got, want)
		}
		// The same launch with programmatic dependent launch: the config
		// struct and its one attribute as C reads them.
		if !LaunchDependentAvailable() {
			return errors.New("cuLaunchKernelEx not bound")
		}
		if err := fn.LaunchDependent(Dim3{X: 4, Y: 2, Z: 3}, Dim3{X: 256, Y: 1, Z: 1}, 4096, s, &args); err != nil {
			return err
		}
		got = m.LastLaunch()
		want = [11]uint64{got[0], 4, 2, 3, 256, 1, 1, 4096, uint64(s), got[9], 1<<32 | 6<<16 | 1}
		if got != want || got[9] == 0 {
			return fmt.Errorf("cuLaunchKernelEx received %v, want %v", got, want)
		}
		res := make([]float32, n)
		check := func(what string) error {
			if err := CopyDtoH(AsBytes(res), out.Ptr()); err != nil {
				return err
			}
			for i := range res {
				if res[i] != av[i]+bv[i] {
					return fmt.Errorf("%s: out[%d] = %v, want %v", what, i, res[i], av[i]+bv[i])
				}
			}
			return nil
		}
		if err := check("launch"); err != nil {
			return err
		}

		// Capture two launches, then replay the graph on new inputs.
		if err := MemsetD32Async(out.Ptr(), 0, n, s); err != nil {
			return err
		}
		if err := s.BeginCapture(CaptureThreadLocal); err != nil {
			return err
		}
		for range 2 {
			if err := fn.Launch(grid, block, 0, s, args.Reset().Ptr(a.Ptr()).Ptr(b.Ptr()).Ptr(out.Ptr()).Int32(n)); err != nil {
				return err
			}
		}
		g, err := s.EndCapture()
		if err != nil {
			return err
		}
		defer g.Destroy()
		if res[0] = -1; CopyDtoH(AsBytes(res[:1]), out.Ptr()) != nil || res[0] != 0 {
			return fmt.Errorf("captured launch ran (out[0] = %v)", res[0])
		}
		nodes, err := g.NodeCount()
		if err != nil || nodes != 2 {
			return fmt.Errorf("NodeCount = %d, %v", nodes, err)
		}
		exec, err := g.Instantiate()
		if err != nil {
			return err
		}
		defer exec.Destroy()
		if err := exec.Upload(s); err != nil {
			return err
		}
		for i := range av {
			av[i] = -av[i]
		}
		if err := CopyHtoDAsync(a.Ptr(), AsBytes(av), s); err != nil {
			return err
		}
		if err := exec.Launch(s); err != nil {
			return err
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		if err := check("graph replay"); err != nil {
			return err
		}

		e0, err := NewEvent()
		if err != nil {
			return err
		}
		e1, err := NewEvent()
		if err != nil {
			return err
		}
		defer e0.Destroy()
		defer e1.Destroy()
		if err := e0.Record(s); err != nil {
			return err
		}
		if err := e1.Record(s); err != nil {
			return err
		}
		if err := e1.Synchronize(); err != nil {
			return err
		}
		if done, err := e1.Done(); !done || err != nil {
			return fmt.Errorf("event done = %v, %v", done, err)
		}
		if err := s.WaitEvent(e1); err != nil {
			return err
		}
		el, err := Elapsed(e0, e1)
		if err != nil || el != 1500*time.Microsecond {
			return fmt.Errorf("Elapsed = %v, %v (the mock reports 1.5 ms)", el, err)
		}
		m.SetBusy(true)
		defer m.SetBusy(false)
		if done, err := s.Done(); done || err != nil {
			return fmt.Errorf("busy stream: done = %v, %v", done, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// bf16 rounds f to bfloat16 (round to nearest even), as bits.
func bf16(f float32) uint16 {
	w := math.Float32bits(f)
	w += 0x7fff + (w>>16)&1
	return uint16(w >> 16)
}

func fromBF16(b uint16) float32 { return math.Float32frombits(uint32(b) << 16) }

func TestMockLinearBF16(t *testing.T) {
	m := useMock(t)
	d := openMock(t, 0)
	const tokens, in, out = 3, 5, 4
	x := make([]uint16, tokens*in)
	w := make([]uint16, out*in) // [out, in], row-major, as in HF checkpoints
	y := make([]uint16, tokens*out)
	for i := range x {
		x[i] = bf16(rand.Float32()*2 - 1)
	}
	for i := range w {
		w[i] = bf16(rand.Float32()*2 - 1)
	}
	for i := range y {
		y[i] = bf16(rand.Float32())
	}
	// Reference: y[t][o] = sum_i x[t][i]*w[o][i] + y[t][o] (beta 1).
	want := make([]float64, tokens*out)
	for tk := range tokens {
		for o := range out {
			acc := float64(fromBF16(y[tk*out+o]))
			for i := range in {
				acc += float64(fromBF16(x[tk*in+i])) * float64(fromBF16(w[o*in+i]))
			}
			want[tk*out+o] = acc
		}
	}
	err := d.Do(func() error {
		buf, err := Alloc(2 * (len(x) + len(w) + len(y)))
		if err != nil {
			return err
		}
		defer buf.Free()
		xp, wp, yp := buf.Ptr(), buf.Ptr()+DevicePtr(2*len(x)), buf.Ptr()+DevicePtr(2*(len(x)+len(w)))
		for _, c := range []struct {
			p DevicePtr
			v []uint16
		}{{xp, x}, {wp, w}, {yp, y}} {
			if err := CopyHtoD(c.p, AsBytes(c.v)); err != nil {
				return err
			}
		}
		b, err := NewBLAS()
		if err != nil {
			return err
		}
		defer b.Destroy()
		if v, err := b.Version(); err != nil || v != 130100 {
			return fmt.Errorf("Version = %d, %v", v, err)
		}
		ws, err := Alloc(1 << 20)
		if err != nil {
			return err
		}
		defer ws.Free()
		if err := b.SetWorkspace(ws); err != nil {
			return err
		}
		if err := b.SetStream(0); err != nil {
			return err
		}
		if err := b.LinearBF16(yp, xp, wp, tokens, in, out, 1); err != nil {
			return err
		}
		args, alpha, beta := m.LastGemm()
		wantArgs := [19]uint64{args[0], 1, 0, out, tokens, in, args[6], uint64(wp), 14, in, uint64(xp), 14, in, args[13], uint64(yp), 14, out, 68, 0xFFFFFFFF}
		if args != wantArgs || alpha != 1 || beta != 1 {
			return fmt.Errorf("cublasGemmEx received %v alpha %v beta %v, want %v", args, alpha, beta, wantArgs)
		}
		if err := CopyDtoH(AsBytes(y), yp); err != nil {
			return err
		}
		for i, v := range y {
			if got := float64(fromBF16(v)); math.Abs(got-want[i]) > 1e-2*math.Max(1, math.Abs(want[i])) {
				return fmt.Errorf("y[%d] = %v, want %v", i, got, want[i])
			}
		}
		// A status error, named from the table: the mock lacks the
		// optional cublasGetStatusName.
		err = b.Gemm(OpN, OpN, 4, 4, 4, 1, xp, R16BF, 1, xp, R16BF, 4, 0, yp, R16BF, 4)
		var e *Error
		if !errors.As(err, &e) || e.Name != "CUBLAS_STATUS_INVALID_VALUE" || e.Lib != "cublas" || !strings.Contains(err.Error(), "gemm m=4 n=4 k=4") {
			return fmt.Errorf("bad lda: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// fnv1a is the checksum the mock computes over the unique id it receives.
func fnv1a(b []byte) uint64 {
	h := uint64(1469598103934665603)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}

func TestMockNCCLStructByValue(t *testing.T) {
	m := useMock(t)
	if m.UniqueIDSize() != int(unsafe.Sizeof(NCCLUniqueID{})) || unsafe.Sizeof(NCCLUniqueID{}) != 128 || unsafe.Alignof(NCCLUniqueID{}) != 1 {
		t.Fatalf("sizeof(ncclUniqueId) = %d in C, %d in Go", m.UniqueIDSize(), unsafe.Sizeof(NCCLUniqueID{}))
	}
	if v, err := NCCLVersion(); err != nil || v != 22809 {
		t.Fatalf("NCCLVersion = %d, %v", v, err)
	}
	if os.Getenv("NCCL_NVLS_ENABLE") == "" {
		t.Fatal("NCCL_NVLS_ENABLE not set before loading NCCL")
	}
	id, err := NewNCCLUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range id.Internal {
		if b != byte(i*7+3) {
			t.Fatalf("ncclGetUniqueId byte %d = %d", i, b)
		}
	}
	// Random ids, passed by value after two scalar arguments and before a
	// third: the C side must see every byte where it expects it.
	d := openMock(t, 0)
	for range 3 {
		for i := range id.Internal {
			id.Internal[i] = byte(rand.IntN(256))
		}
		var comm *NCCLComm
		if err := d.Do(func() (err error) {
			comm, err = NCCLInitRank(5, id, 3)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if got, want := m.LastInit(), [4]uint64{5, 3, fnv1a(id.Internal[:]), 1}; got != want {
			t.Fatalf("ncclCommInitRank received %v, want %v", got, want)
		}
		if comm.Rank() != 3 || comm.Ranks() != 5 {
			t.Fatalf("comm rank %d of %d", comm.Rank(), comm.Ranks())
		}
		if err := d.Do(comm.Destroy); err != nil {
			t.Fatal(err)
		}
	}
	err = d.Do(func() error {
		_, err := NCCLInitRank(2, id, 2)
		return err
	})
	var e *Error
	if !errors.As(err, &e) || e.Name != "ncclInvalidArgument" || !strings.Contains(e.Msg, "invalid argument") || e.Lib != "nccl" {
		t.Fatalf("rank out of range: %v", err)
	}
}

func TestMockNCCLSendRecv(t *testing.T) {
	m := useMock(t)
	d := openMock(t, 0)
	id, err := NewNCCLUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	const n = 300
	src := make([]uint16, n)
	for i := range src {
		src[i] = uint16(rand.Uint32())
	}
	dst := make([]uint16, n)
	err = d.Do(func() error {
		c0, err := NCCLInitRank(2, id, 0)
		if err != nil {
			return err
		}
		c1, err := NCCLInitRank(2, id, 1)
		if err != nil {
			return err
		}
		defer c1.Destroy()
		buf, err := Alloc(4 * n)
		if err != nil {
			return err
		}
		defer buf.Free()
		if err := CopyHtoD(buf.Ptr(), AsBytes(src)); err != nil {
			return err
		}
		if err := NCCLGroupStart(); err != nil {
			return err
		}
		if err := c0.Send(buf.Ptr(), n, NCCLBfloat16, 1, 0); err != nil {
			return err
		}
		if err := NCCLGroupEnd(); err != nil {
			return err
		}
		if err := c1.Recv(buf.Ptr()+2*n, n, NCCLBfloat16, 0, 0); err != nil {
			return err
		}
		if err := CopyDtoH(AsBytes(dst), buf.Ptr()+2*n); err != nil {
			return err
		}
		if err := c0.Send(buf.Ptr(), n, NCCLBfloat16, 0, 0); err == nil || !strings.Contains(err.Error(), "mock: last error") {
			return fmt.Errorf("send to self: %v, want NCCL's last error in the message", err)
		}
		if err := c0.AsyncError(); err != nil {
			return err
		}
		m.SetAsyncError(6)
		defer m.SetAsyncError(0)
		var e *Error
		if err := c0.AsyncError(); !errors.As(err, &e) || e.Name != "ncclRemoteError" {
			return fmt.Errorf("async error = %v", err)
		}
		if err := c0.Abort(); err != nil {
			return err
		}
		if err := c0.Abort(); err != nil || m.Aborts() != 1 {
			return fmt.Errorf("second abort: %v, %d aborts", err, m.Aborts())
		}
		if err := c0.Send(buf.Ptr(), n, NCCLBfloat16, 1, 0); !errors.Is(err, ErrCommAborted) {
			return fmt.Errorf("send after abort: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range src {
		if dst[i] != src[i] {
			t.Fatalf("received[%d] = %#x, want %#x", i, dst[i], src[i])
		}
	}
}

func TestKernelArgsLayout(t *testing.T) {
	var a KernelArgs
	type pair struct {
		A int32
		B float32
		C uint64
	}
	p := pair{A: -7, B: 2.5, C: 1 << 40}
	a.Ptr(0xdeadbeef).Int32(-2).Float32(1.5).Bytes(unsafe.Slice((*byte)(unsafe.Pointer(&p)), unsafe.Sizeof(p))).Uint64(9)
	if a.Len() != 5 {
		t.Fatalf("Len = %d", a.Len())
	}
	ptrs := unsafe.Slice((*unsafe.Pointer)(a.pointers()), a.Len())
	if *(*uint64)(ptrs[0]) != 0xdeadbeef || *(*int32)(ptrs[1]) != -2 || *(*float32)(ptrs[2]) != 1.5 || *(*pair)(ptrs[3]) != p || *(*uint64)(ptrs[4]) != 9 {
		t.Fatal("parameter slots do not hold the values")
	}
	for i, q := range ptrs {
		if uintptr(q)%8 != 0 {
			t.Fatalf("slot %d not 8-byte aligned", i)
		}
	}
	if a.Reset().Len() != 0 || a.pointers() != nil {
		t.Fatal("Reset left parameters")
	}
}
