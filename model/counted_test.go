package model_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
)

// TestStageBytes sums, independently of the checkpoint's own list, the
// stored sizes of the tensors each stage of a 4-layer model reads, tied
// and untied.
func TestStageBytes(t *testing.T) {
	for _, tied := range []bool{false, true} {
		o := randinit.DefaultOptions()
		o.Tied = tied
		ck := open(t, write(t, o))
		size := map[string]int64{}
		var all int64
		for _, n := range ck.Names() {
			tn, err := ck.Tensor(n)
			if err != nil {
				t.Fatal(err)
			}
			size[n] = int64(len(tn.Data))
			all += size[n]
		}
		layers := func(lo, hi int) (n int64) {
			for name, s := range size {
				for i := lo; i < hi; i++ {
					if strings.HasPrefix(name, model.LayerTensor(i, "")) {
						n += s
					}
				}
			}
			return n
		}
		head := size[model.LMHeadName]
		if tied {
			head = size[model.EmbedName]
		}
		for _, c := range []struct {
			lo, hi      int
			first, last bool
			want        int64
		}{
			{0, 4, true, true, all},
			{0, 2, true, false, size[model.EmbedName] + layers(0, 2)},
			{2, 4, false, true, layers(2, 4) + size[model.NormName] + head},
			{1, 3, false, false, layers(1, 3)},
		} {
			got, err := ck.StageBytes(c.lo, c.hi, c.first, c.last)
			if err != nil || got != c.want {
				t.Errorf("tied %t: StageBytes(%d, %d, %t, %t) = %d, %v; want %d", tied, c.lo, c.hi, c.first, c.last, got, err, c.want)
			}
		}
		if _, err := ck.StageBytes(2, 9, false, true); err == nil {
			t.Errorf("StageBytes past the last layer: no error")
		}
	}
}

// TestCounted: a reader going through a stage's tensors is reported 0 at
// the first, then the bytes of the tensors before each one it asks for,
// each tensor once, and StageBytes once it finishes.
func TestCounted(t *testing.T) {
	ck := open(t, write(t, randinit.DefaultOptions()))
	var reports []int64
	r := ck.Counted(func(done int64) { reports = append(reports, done) })
	names := []string{model.LayerTensor(0, model.QProj), model.LayerTensor(0, model.KProj), model.LayerTensor(0, model.QProj), model.LayerTensor(0, model.VProj)}
	var sizes []int64
	for _, n := range names {
		tn, err := r.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, int64(len(tn.Data)))
	}
	r.Finish()
	q, k, v := sizes[0], sizes[1], sizes[3]
	want := []int64{0, q, q + k, q + k, q + k + v}
	if !slices.Equal(reports, want) {
		t.Errorf("reports %v, want %v", reports, want)
	}
	if _, err := r.Tensor("no.such.tensor"); err == nil {
		t.Error("Counted.Tensor of a missing tensor: no error")
	}
	var last int64
	whole := ck.Counted(func(done int64) { last = done })
	for _, n := range ck.Names() {
		if _, err := whole.Tensor(n); err != nil {
			t.Fatal(err)
		}
	}
	whole.Finish()
	cfg := ck.Config()
	if total, err := ck.StageBytes(0, cfg.NumLayers, true, true); err != nil || last != total {
		t.Errorf("every tensor read: %d bytes reported, StageBytes %d (%v)", last, total, err)
	}
}
