package gputest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/collective/nccl"
	"github.com/tandem-llm/tandem/gpu"
)

// open returns device ordinal, or skips the test when there is no GPU.
func open(t *testing.T, ordinal int) *gpu.Device {
	t.Helper()
	if err := gpu.Probe(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	if n, _ := gpu.DeviceCount(); n <= ordinal {
		t.Skipf("skipping: needs %d CUDA devices, have %d", ordinal+1, n)
	}
	d, err := gpu.Open(ordinal)
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

func do(t *testing.T, d *gpu.Device, f func() error) {
	t.Helper()
	if err := d.Do(f); err != nil {
		t.Fatal(err)
	}
}

const kernelsSrc = `
extern "C" __global__ void vec_add(const float* a, const float* b, float* out, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) out[i] = a[i] + b[i];
}
extern "C" __global__ void axpy(const float* x, float* y, float alpha, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) y[i] += alpha * x[i];
}
// Reverses n floats through dynamic shared memory (one block).
extern "C" __global__ void reverse_shared(const float* in, float* out, int n) {
	extern __shared__ float s[];
	for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = in[i];
	__syncthreads();
	for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = s[n - 1 - i];
}
`

func randFloats(n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = rand.Float32()*2 - 1
	}
	return v
}

func TestDeviceAndMemory(t *testing.T) {
	d := open(t, 0)
	info := d.Info()
	v, _ := gpu.DriverVersion()
	t.Logf("device %d: %s %s, %d SMs, %.1f GiB, L2 %d MiB, shared opt-in %d KiB, driver CUDA %d",
		info.Ordinal, info.Name, info.Arch(), info.SMs, float64(info.TotalMem)/(1<<30), info.L2Bytes>>20, info.MaxSharedPerBlockOptin>>10, v)
	if info.Major < 7 || info.SMs == 0 || info.TotalMem == 0 {
		t.Fatalf("implausible device info %+v", info)
	}
	do(t, d, func() error {
		const n = 64 << 20
		m, err := gpu.Alloc(n)
		if err != nil {
			return err
		}
		defer m.Free()
		free, total, err := gpu.MemInfo()
		if err != nil {
			return err
		}
		if total != int(info.TotalMem) || free <= 0 || free > total {
			t.Errorf("MemInfo free %d total %d, device total %d", free, total, info.TotalMem)
		}
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(rand.Uint32())
		}
		if err := gpu.CopyHtoD(m.Ptr(), src); err != nil {
			return err
		}
		s, err := gpu.NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()
		m2, err := gpu.Alloc(n)
		if err != nil {
			return err
		}
		defer m2.Free()
		if err := gpu.MemsetD8Async(m2.Ptr(), 0xAB, n, s); err != nil {
			return err
		}
		if err := gpu.CopyDtoDAsync(m2.Ptr(), m.Ptr(), n-4096, s); err != nil {
			return err
		}
		if err := gpu.MemsetD32Async(m2.Ptr()+n-4096, 0x01020304, 1024, s); err != nil {
			return err
		}
		host, err := gpu.AllocHost(n)
		if err != nil {
			return err
		}
		defer gpu.FreeHost(host)
		if err := gpu.CopyDtoHAsync(host, m2.Ptr(), s); err != nil {
			return err
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		for i := 0; i < n-4096; i++ {
			if host[i] != src[i] {
				t.Fatalf("byte %d: %#x, want %#x", i, host[i], src[i])
			}
		}
		for i := n - 4096; i < n; i++ {
			if want := byte(4 - i%4); host[i] != want {
				t.Fatalf("memset byte %d: %#x, want %#x", i, host[i], want)
			}
		}
		return nil
	})
}

func TestCompileLaunchGraph(t *testing.T) {
	d := open(t, 0)
	start := time.Now()
	c, err := gpu.Compile(kernelsSrc, "kernels.cu", "--gpu-architecture="+d.Info().Arch(), "-default-device", "-std=c++17")
	if err != nil {
		t.Fatal(err)
	}
	ma, mi, _ := gpu.NVRTCVersion()
	t.Logf("NVRTC %d.%d compiled %d bytes of CUBIN in %v (PTX %v)", ma, mi, len(c.Image), time.Since(start), c.PTX)
	if c.PTX {
		t.Fatal("got PTX for a real architecture")
	}
	if _, err := gpu.Compile("__global__ void k() { undefined_name(); }", "bad.cu", "--gpu-architecture="+d.Info().Arch()); err == nil || !strings.Contains(err.Error(), "undefined_name") {
		t.Fatalf("failed compile: %v, want the log naming the error", err)
	}
	do(t, d, func() error {
		mod, err := gpu.LoadModule(c.Image)
		if err != nil {
			return err
		}
		defer mod.Unload()
		vecAdd, err := mod.Function("vec_add")
		if err != nil {
			return err
		}
		axpy, err := mod.Function("axpy")
		if err != nil {
			return err
		}
		rev, err := mod.Function("reverse_shared")
		if err != nil {
			return err
		}
		s, err := gpu.NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()

		const n = 1<<20 + 17
		buf, err := gpu.Alloc(4 * 3 * n)
		if err != nil {
			return err
		}
		defer buf.Free()
		a, b, out := buf.Slice(0, 4*n), buf.Slice(4*n, 4*n), buf.Slice(8*n, 4*n)
		av, bv := randFloats(n), randFloats(n)
		if err := gpu.CopyHtoD(a.Ptr(), gpu.AsBytes(av)); err != nil {
			return err
		}
		if err := gpu.CopyHtoD(b.Ptr(), gpu.AsBytes(bv)); err != nil {
			return err
		}
		if err := gpu.MemsetD32Async(out.Ptr(), math.Float32bits(float32(math.NaN())), n, s); err != nil {
			return err
		}
		var args gpu.KernelArgs
		grid := gpu.Dim3{X: uint32((n + 255) / 256)}
		block := gpu.Dim3{X: 256}
		if err := vecAdd.Launch(grid, block, 0, s, args.Reset().Ptr(a.Ptr()).Ptr(b.Ptr()).Ptr(out.Ptr()).Int32(n)); err != nil {
			return err
		}
		res := make([]float32, n)
		if err := gpu.CopyDtoHAsync(gpu.AsBytes(res), out.Ptr(), s); err != nil {
			return err
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		for i := range res {
			if res[i] != av[i]+bv[i] {
				t.Fatalf("vec_add[%d] = %v, want %v", i, res[i], av[i]+bv[i])
			}
		}
		t.Logf("vec_add of %d elements checked", n)

		// Dynamic shared memory above the 48 KiB default.
		const sn = 100 << 10 / 4
		if err := rev.SetMaxDynamicSharedMem(4 * sn); err != nil {
			return err
		}
		if err := rev.Launch(gpu.Dim3{X: 1}, gpu.Dim3{X: 1024}, 4*sn, s, args.Reset().Ptr(a.Ptr()).Ptr(out.Ptr()).Int32(sn)); err != nil {
			return err
		}
		if err := gpu.CopyDtoHAsync(gpu.AsBytes(res[:sn]), out.Ptr(), s); err != nil {
			return err
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		for i := range sn {
			if res[i] != av[sn-1-i] {
				t.Fatalf("reverse_shared[%d] = %v, want %v", i, res[i], av[sn-1-i])
			}
		}

		// Capture y += 1x; y += 2x; y += 3x and replay it three times.
		if err := gpu.CopyHtoDAsync(out.Ptr(), gpu.AsBytes(bv), s); err != nil {
			return err
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		if err := s.BeginCapture(gpu.CaptureThreadLocal); err != nil {
			return err
		}
		for k := 1; k <= 3; k++ {
			if err := axpy.Launch(grid, block, 0, s, args.Reset().Ptr(a.Ptr()).Ptr(out.Ptr()).Float32(float32(k)).Int32(n)); err != nil {
				s.EndCapture()
				return err
			}
		}
		g, err := s.EndCapture()
		if err != nil {
			return err
		}
		defer g.Destroy()
		nodes, err := g.NodeCount()
		if err != nil {
			return err
		}
		if nodes != 3 {
			t.Errorf("graph has %d nodes, want 3", nodes)
		}
		exec, err := g.Instantiate()
		if err != nil {
			return err
		}
		defer exec.Destroy()
		if err := exec.Upload(s); err != nil {
			return err
		}
		e0, err := gpu.NewEvent()
		if err != nil {
			return err
		}
		defer e0.Destroy()
		e1, err := gpu.NewEvent()
		if err != nil {
			return err
		}
		defer e1.Destroy()
		if err := e0.Record(s); err != nil {
			return err
		}
		for range 3 {
			if err := exec.Launch(s); err != nil {
				return err
			}
		}
		if err := e1.Record(s); err != nil {
			return err
		}
		if err := gpu.CopyDtoHAsync(gpu.AsBytes(res), out.Ptr(), s); err != nil {
			return err
		}
		if err := s.Synchronize(); err != nil {
			return err
		}
		for i := range res {
			want := bv[i] + 18*av[i]
			if math.Abs(float64(res[i]-want)) > 1e-5*(1+math.Abs(float64(want))) {
				t.Fatalf("graph replay [%d] = %v, want %v", i, res[i], want)
			}
		}
		el, err := gpu.Elapsed(e0, e1)
		if err != nil {
			return err
		}
		t.Logf("graph of %d nodes replayed 3 times in %v (checked)", nodes, el)

		// Launch overhead through SyscallN, eager.
		const launches = 2000
		small := gpu.Dim3{X: 1}
		args.Reset().Ptr(a.Ptr()).Ptr(out.Ptr()).Float32(0).Int32(1)
		t0 := time.Now()
		for range launches {
			if err := axpy.Launch(small, block, 0, s, &args); err != nil {
				return err
			}
		}
		host := time.Since(t0)
		if err := s.Synchronize(); err != nil {
			return err
		}
		t.Logf("eager launch: %.2f µs host time per launch (%d launches)", float64(host.Microseconds())/launches, launches)
		return nil
	})
}

func TestEventsCopyBandwidth(t *testing.T) {
	d := open(t, 0)
	do(t, d, func() error {
		const n = 1 << 30
		m, err := gpu.Alloc(2 * n)
		if err != nil {
			return err
		}
		defer m.Free()
		s, err := gpu.NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()
		e0, _ := gpu.NewEvent()
		e1, _ := gpu.NewEvent()
		defer e0.Destroy()
		defer e1.Destroy()
		if err := gpu.MemsetD32Async(m.Ptr(), 0x3f800000, n/4, s); err != nil {
			return err
		}
		var best time.Duration
		for range 5 {
			e0.Record(s)
			if err := gpu.CopyDtoDAsync(m.Ptr()+n, m.Ptr(), n, s); err != nil {
				return err
			}
			e1.Record(s)
			if err := e1.Synchronize(); err != nil {
				return err
			}
			el, err := gpu.Elapsed(e0, e1)
			if err != nil {
				return err
			}
			if best == 0 || el < best {
				best = el
			}
		}
		if best <= 0 {
			t.Fatalf("event timing %v", best)
		}
		t.Logf("device-to-device copy 1 GiB: best %v, %.2f TB/s (read+write)", best, 2*float64(n)/best.Seconds()/1e12)
		return nil
	})
}

func bf16(f float32) uint16 {
	w := math.Float32bits(f)
	w += 0x7fff + (w>>16)&1
	return uint16(w >> 16)
}

func fromBF16(b uint16) float64 { return float64(math.Float32frombits(uint32(b) << 16)) }

func randBF16(n int) []uint16 {
	v := make([]uint16, n)
	for i := range v {
		v[i] = bf16(rand.Float32()*2 - 1)
	}
	return v
}

// linearRef is y = x·Wᵀ + beta·y0 in float64 for row-major x [T, in] and
// w [out, in].
func linearRef(x, w, y0 []uint16, tokens, in, out int, beta float64) []float64 {
	ref := make([]float64, tokens*out)
	for tk := range tokens {
		for o := range out {
			acc := 0.0
			for i := range in {
				acc += fromBF16(x[tk*in+i]) * fromBF16(w[o*in+i])
			}
			ref[tk*out+o] = acc + beta*fromBF16(y0[tk*out+o])
		}
	}
	return ref
}

func relErr(got []uint16, ref []float64) float64 {
	var num, den float64
	for i, r := range ref {
		g := fromBF16(got[i])
		if math.IsNaN(g) {
			return math.Inf(1)
		}
		num += (g - r) * (g - r)
		den += r * r
	}
	return math.Sqrt(num / den)
}

func TestGemmBF16(t *testing.T) {
	d := open(t, 0)
	const tokens, in, out = 37, 1024, 768
	x, w, y0 := randBF16(tokens*in), randBF16(out*in), randBF16(tokens*out)
	do(t, d, func() error {
		b, err := gpu.NewBLAS()
		if err != nil {
			return err
		}
		defer b.Destroy()
		ver, _ := b.Version()
		s, err := gpu.NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()
		ws, err := gpu.Alloc(32 << 20)
		if err != nil {
			return err
		}
		defer ws.Free()
		if err := b.SetStream(s); err != nil {
			return err
		}
		if err := b.SetWorkspace(ws); err != nil {
			return err
		}
		buf, err := gpu.Alloc(2 * (len(x) + len(w) + len(y0)))
		if err != nil {
			return err
		}
		defer buf.Free()
		xp := buf.Ptr()
		wp := xp + gpu.DevicePtr(2*len(x))
		yp := wp + gpu.DevicePtr(2*len(w))
		gpu.CopyHtoD(xp, gpu.AsBytes(x))
		gpu.CopyHtoD(wp, gpu.AsBytes(w))
		y := make([]uint16, len(y0))
		for _, tc := range []struct {
			beta    float64
			capture bool
		}{{0, false}, {1, false}, {1, true}} {
			if err := gpu.CopyHtoD(yp, gpu.AsBytes(y0)); err != nil {
				return err
			}
			if tc.capture {
				if err := s.BeginCapture(gpu.CaptureThreadLocal); err != nil {
					return err
				}
			}
			if err := b.LinearBF16(yp, xp, wp, tokens, in, out, float32(tc.beta)); err != nil {
				if tc.capture {
					s.EndCapture()
				}
				return err
			}
			if tc.capture {
				g, err := s.EndCapture()
				if err != nil {
					return err
				}
				exec, err := g.Instantiate()
				g.Destroy()
				if err != nil {
					return err
				}
				err = exec.Launch(s)
				exec.Destroy()
				if err != nil {
					return err
				}
			}
			if err := gpu.CopyDtoHAsync(gpu.AsBytes(y), yp, s); err != nil {
				return err
			}
			if err := s.Synchronize(); err != nil {
				return err
			}
			e := relErr(y, linearRef(x, w, y0, tokens, in, out, tc.beta))
			t.Logf("cuBLAS %d LinearBF16 %dx%d·(%dx%d)ᵀ beta %v captured %v: rel err %.2e", ver, tokens, in, out, in, tc.beta, tc.capture, e)
			if e > 1e-2 {
				t.Errorf("rel err %.3e > 1e-2", e)
			}
		}

		// Throughput of a large GEMM, for the record.
		const N = 4096
		big, err := gpu.Alloc(3 * 2 * N * N)
		if err != nil {
			return err
		}
		defer big.Free()
		r := randBF16(N * N)
		gpu.CopyHtoD(big.Ptr(), gpu.AsBytes(r))
		gpu.CopyHtoD(big.Ptr()+2*N*N, gpu.AsBytes(r))
		e0, _ := gpu.NewEvent()
		e1, _ := gpu.NewEvent()
		defer e0.Destroy()
		defer e1.Destroy()
		for range 3 {
			b.LinearBF16(big.Ptr()+4*N*N, big.Ptr(), big.Ptr()+2*N*N, N, N, N, 0)
		}
		e0.Record(s)
		const reps = 20
		for range reps {
			if err := b.LinearBF16(big.Ptr()+4*N*N, big.Ptr(), big.Ptr()+2*N*N, N, N, N, 0); err != nil {
				return err
			}
		}
		e1.Record(s)
		if err := e1.Synchronize(); err != nil {
			return err
		}
		el, _ := gpu.Elapsed(e0, e1)
		t.Logf("bf16 GEMM %d^3: %.0f TFLOP/s", N, 2*N*N*N*reps/el.Seconds()/1e12)
		return nil
	})
}

// commPair joins devices 0 and 1 into one two-rank communicator, blocking
// (gpu.NCCLInitRank) or non-blocking (nccl.Connect).
func commPair(t *testing.T, nonBlocking bool) (devs [2]*gpu.Device, comms [2]*gpu.NCCLComm, streams [2]gpu.Stream) {
	devs[0], devs[1] = open(t, 0), open(t, 1)
	id, err := nccl.NewUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	v, _ := gpu.NCCLVersion()
	wire := nccl.EncodeUniqueID(id)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for r := range 2 {
		wg.Go(func() {
			rid, err := nccl.DecodeUniqueID(wire)
			if err != nil {
				errs[r] = err
				return
			}
			if nonBlocking {
				comms[r], errs[r] = nccl.Connect(ctx, devs[r], 2, rid, r)
			}
			errs[r] = errors.Join(errs[r], devs[r].Do(func() (err error) {
				if !nonBlocking {
					if comms[r], err = gpu.NCCLInitRank(2, rid, r); err != nil {
						return err
					}
				}
				streams[r], err = gpu.NewStream()
				return err
			}))
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	t.Logf("NCCL %d: 2 ranks joined (non-blocking %v) in %v", v, nonBlocking, time.Since(start))
	return devs, comms, streams
}

func TestNCCLSendRecv(t *testing.T) {
	for _, nonBlocking := range []bool{false, true} {
		t.Run(fmt.Sprintf("nonblocking=%v", nonBlocking), func(t *testing.T) {
			testSendRecv(t, nonBlocking)
		})
	}
}

func testSendRecv(t *testing.T, nonBlocking bool) {
	devs, comms, streams := commPair(t, nonBlocking)
	defer func() {
		// Each rank destroys its communicator on its own goroutine:
		// NCCL may synchronize the ranks while finalizing.
		var wg sync.WaitGroup
		for r := range 2 {
			wg.Go(func() {
				if err := devs[r].Do(func() error {
					streams[r].Destroy()
					return comms[r].Destroy()
				}); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
	}()
	const maxBytes = 256 << 20
	var src, dst gpu.Mem
	do(t, devs[0], func() (err error) { src, err = gpu.Alloc(maxBytes); return err })
	defer devs[0].Do(src.Free)
	do(t, devs[1], func() (err error) { dst, err = gpu.Alloc(maxBytes); return err })
	defer devs[1].Do(dst.Free)
	snd, err := nccl.NewSender(nccl.Config{Device: devs[0], Comm: comms[0], Peer: 1, Stream: streams[0]})
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close()
	rcv, err := nccl.NewReceiver(nccl.Config{Device: devs[1], Comm: comms[1], Peer: 0, Stream: streams[1]})
	if err != nil {
		t.Fatal(err)
	}
	defer rcv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	transfer := func(h collective.Header) time.Duration {
		errc := make(chan error, 1)
		start := time.Now()
		go func() { errc <- snd.Send(ctx, h, src) }()
		if err := rcv.Recv(ctx, h, dst); err != nil {
			t.Fatal(err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		return time.Since(start)
	}
	var checked int
	for batch, rows := range []int{1, 17, 512, 1, 1, 1} {
		h := collective.Header{Batch: uint64(batch), Rows: rows, Cols: 2048, DType: collective.BF16}
		data := randBF16(h.Rows * h.Cols)
		do(t, devs[0], func() error { return gpu.CopyHtoD(src.Ptr(), gpu.AsBytes(data)) })
		do(t, devs[1], func() error {
			if err := gpu.MemsetD8Async(dst.Ptr(), 0xff, h.Bytes(), streams[1]); err != nil {
				return err
			}
			return streams[1].Synchronize()
		})
		el := transfer(h)
		got := make([]uint16, len(data))
		do(t, devs[1], func() error { return gpu.CopyDtoH(gpu.AsBytes(got), dst.Ptr()) })
		for i := range data {
			if got[i] != data[i] {
				t.Fatalf("batch %d element %d: %#x, want %#x", batch, i, got[i], data[i])
			}
		}
		checked += h.Bytes()
		t.Logf("batch %d: %d x %d bf16 (%d bytes) sent and checked in %v", batch, h.Rows, h.Cols, h.Bytes(), el)
	}
	small := collective.Header{Batch: 50, Rows: 1, Cols: 2048, DType: collective.BF16}
	var lat []time.Duration
	for range 50 {
		lat = append(lat, transfer(small))
	}
	slices.Sort(lat)
	t.Logf("4 KiB send+recv round, host-timed over 50: median %v, min %v", lat[len(lat)/2], lat[0])
	big := collective.Header{Batch: 99, Rows: maxBytes / 2 / 8192, Cols: 8192, DType: collective.BF16}
	for range 2 {
		el := transfer(big)
		t.Logf("256 MiB GPU0->GPU1: %v, %.0f GB/s (host-timed, incl. polling)", el, float64(maxBytes)/el.Seconds()/1e9)
	}
	t.Logf("NCCL: %d bytes checked", checked)
}

func TestNCCLLostPeer(t *testing.T) {
	for _, tc := range []struct {
		name        string
		nonBlocking bool
		warm        bool
	}{
		// A non-blocking communicator whose peer never connects: the
		// receive gives up during connection setup.
		{"nonblocking-unconnected", true, false},
		// Connected by one transfer, then the peer goes silent: the
		// receive gives up while its kernel waits on the stream.
		{"blocking-connected", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			devs, comms, streams := commPair(t, tc.nonBlocking)
			defer func() {
				for r := range 2 {
					devs[r].Do(streams[r].Destroy)
				}
			}()
			var src, dst gpu.Mem
			do(t, devs[0], func() (err error) { src, err = gpu.Alloc(1 << 20); return err })
			defer devs[0].Do(src.Free)
			do(t, devs[1], func() (err error) { dst, err = gpu.Alloc(1 << 20); return err })
			defer devs[1].Do(dst.Free)
			rcv, err := nccl.NewReceiver(nccl.Config{Device: devs[1], Comm: comms[1], Peer: 0, Stream: streams[1]})
			if err != nil {
				t.Fatal(err)
			}
			defer rcv.Close()
			h := collective.Header{Rows: 4, Cols: 1024, DType: collective.BF16}
			if tc.warm {
				snd, err := nccl.NewSender(nccl.Config{Device: devs[0], Comm: comms[0], Peer: 1, Stream: streams[0]})
				if err != nil {
					t.Fatal(err)
				}
				errc := make(chan error, 1)
				go func() { errc <- snd.Send(context.Background(), h, src) }()
				if err := rcv.Recv(context.Background(), h, dst); err != nil {
					t.Fatal(err)
				}
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
				snd.Close()
			}
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()
			start := time.Now()
			err = rcv.Recv(ctx, h, dst)
			el := time.Since(start)
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Recv without a sender = %v", err)
			}
			t.Logf("receive from a silent peer returned after %v: %v", el, err)
			if el > 10*time.Second {
				t.Fatalf("took %v", el)
			}
			if err := comms[0].Abort(); err != nil {
				t.Fatal(err)
			}
			// The aborted receive must not leave the device stuck.
			do(t, devs[1], func() error { return streams[1].Synchronize() })
		})
	}
}
