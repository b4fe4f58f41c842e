package collective_test

import (
	"context"
	"fmt"

	"github.com/tandem-llm/tandem/collective"
)

func ExamplePipe() {
	send, recv := collective.Pipe(2)
	defer send.Close()
	defer recv.Close()
	ctx := context.Background()

	h := collective.Header{Batch: 1, Rows: 2, Cols: 2, DType: collective.F16}
	out := collective.Host("activations!")
	if err := send.Send(ctx, h, out); err != nil {
		fmt.Println(err)
	}
	in := make(collective.Host, 16)
	if err := recv.Recv(ctx, h, in); err != nil {
		fmt.Println(err)
	}
	fmt.Printf("%s\n", in[:h.Bytes()])

	// The receiver states what it expects; another batch is an error.
	h.Batch = 2
	if err := send.Send(ctx, h, out); err != nil {
		fmt.Println(err)
	}
	h.Batch = 3
	fmt.Println(recv.Recv(ctx, h, in))
	// Output:
	// activati
	// collective: pipe recv batch 3 [2x2 f16]: header mismatch: got batch 2, want 3 (link broken)
}

func ExampleDialConfig_Dial() {
	ctx := context.Background()
	ln, err := collective.ListenConfig{Link: "stage0->stage1"}.Listen("127.0.0.1:0")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer ln.Close()
	accepted := make(chan collective.Receiver)
	go func() {
		recv, err := ln.Accept(ctx)
		if err != nil {
			fmt.Println(err)
		}
		accepted <- recv
	}()
	send, err := collective.DialConfig{Link: "stage0->stage1"}.Dial(ctx, ln.Addr().String())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer send.Close()
	recv := <-accepted
	defer recv.Close()

	h := collective.Header{Batch: 7, Rows: 1, Cols: 3, DType: collective.F32}
	if err := send.Send(ctx, h, collective.Host("over the wire")); err != nil {
		fmt.Println(err)
	}
	in := make(collective.Host, h.Bytes())
	if err := recv.Recv(ctx, h, in); err != nil {
		fmt.Println(err)
	}
	fmt.Printf("%s\n", in)
	// Output: over the wir
}
